"""The search loop on a synthetic evaluator (the real cost model for speed, a fixed function of the
params for accuracy): defaults first, the cascade, failed trials, interrupt and resume, stale-trial
expiry, refused resumes, and the run folder. The engine-backed evaluator is tested on the real
model in test_search_engine.py."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import optuna
import pytest
from optuna.trial import TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.loader import get_flow_class
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.space import suggest
from sparsetune.tuning.cascade import run_trial
from sparsetune.tuning.confirm import CONFIRM_SEED_OFFSET, confirm_reserve, to_confirm
from sparsetune.tuning.policy import Budget
from sparsetune.tuning.report import against_defaults_lines
from sparsetune.tuning.run import run_search
from sparsetune.tuning.storage import open_storage, stored_config
from sparsetune.tuning.studies import default_trial_params, open_flows, trial_records
from sparsetune.tuning.workers import LEASE_S, ask, expire_stale
from helpers import SyntheticEvaluator


def _cfg(tmp_path, **kw) -> SearchConfig:
    base = dict(study="s", out=str(tmp_path), trials=10, context=2048, min_accuracy=0.9, confirm_samples=2)
    return SearchConfig(**{**base, **kw})


def test_search_starts_from_the_defaults_and_writes_a_confirmed_frontier(tmp_path):
    cfg = _cfg(tmp_path)
    ev = SyntheticEvaluator(cfg)
    result = run_search(cfg, ev)
    flows = open_flows(cfg, create=False)
    for key, study in flows.studies.items():  # each flow's first trial is its defaults
        first = study.get_trials()[0]
        assert first.user_attrs["role"] == "defaults"
        assert first.params == default_trial_params(get_flow_class(key), 30, {})
        assert first.params["block_size"] == 16 and first.params["budget_ratio"] == 0.125
        # then each other block size at the defaults (one factor at a time), before any sampled point
        sweep = [t for t in study.get_trials() if t.user_attrs["role"] == "sweep"]
        assert [t.number for t in sweep] == [1, 2, 3, 4]
        assert sorted(t.params["block_size"] for t in sweep) == [2, 4, 8, 32]
        assert all({**t.params, "block_size": 16} == first.params for t in sweep)
    order = [(c[0], c[1]["block_size"]) for c in ev.calls[:4]]  # the flows' seeds interleave
    assert order == [("quest", "16"), ("block_topk", "16"), ("quest", "2"), ("block_topk", "2")]
    records = trial_records(flows)
    assert len(records) == 10 == result["trials"]["finished"] + result["trials"]["failed"]
    eligible = [r for r in records if r["stage"] == "full" and r["accuracy"]["relative_accuracy"] >= 0.9]
    front = result["frontier"]
    assert front and {r["trial"] for r in front} <= {f"{r['flow']}#{r['number']}" for r in eligible}
    for r in front:  # no eligible trial beats a frontier point in both objectives
        assert not any(e["accuracy"]["relative_accuracy"] >= r["relative_accuracy"] and e["speed"]["speedup"] >= r["speedup"]
                       and (e["accuracy"]["relative_accuracy"], e["speed"]["speedup"]) != (r["relative_accuracy"], r["speedup"])
                       for e in eligible)
    # confirmation: every frontier point and both defaults, on fresh prompts (another seed, more samples)
    confirm_calls = [c for c in ev.calls if c[3] == cfg.seed + CONFIRM_SEED_OFFSET]
    assert len(confirm_calls) == len(front) + 2 and all(c[2] == 2 for c in confirm_calls)
    assert result["confirmed_frontier"] and all(r["holds"] and r["confirmed_accuracy"] is not None
                                                for r in result["confirmed_frontier"])
    assert len(result["defaults"]) == 2 and all(r["confirmed_accuracy"] is not None for r in result["defaults"])
    for r in result["defaults"]:  # the dense layers' whole context, then 1/8 of it on the other layers
        dense = len(r["params"]["dense_layers"].split(","))
        assert r["share"] == round((dense + (30 - dense) * 0.125) / 30, 4)
    assert [a["defaults"] for a in result["against_defaults"]] == [r["trial"] for r in result["defaults"]]
    run_dir = tmp_path / "s"
    assert {p.name for p in run_dir.iterdir()} >= {"study.journal", "search.json", "trials.jsonl", "frontier.json",
                                                  "frontier.md", "frontier.png", "hypervolume.png"}
    assert len((run_dir / "trials.jsonl").read_text().splitlines()) == 10
    assert json.loads((run_dir / "frontier.json").read_text()) == result
    assert "## Confirmed frontier" in (run_dir / "frontier.md").read_text()


def test_the_cascade_stops_slow_points_before_accuracy_and_hopeless_ones_after_a_chunk(tmp_path):
    cfg = _cfg(tmp_path, context=256)
    ev = SyntheticEvaluator(cfg)
    slow = run_trial(cfg, ev, "quest", {"block_size": "2", "budget_ratio": "0.5"}, tmp_path / "t")
    assert slow["stage"] == "speed" and slow["speed"]["speedup"] <= 1 and "dense is as fast" in slow["reason"]
    assert ev.calls == []  # no accuracy was run for it
    bad = run_trial(cfg, ev, "quest", {"block_size": "32", "budget_ratio": "0.02"}, tmp_path / "t")
    assert bad["stage"] == "quick" and not bad["accuracy"]["complete"] and bad["accuracy"]["samples"] == 4
    good = run_trial(cfg, ev, "quest", {"block_size": "2", "budget_ratio": "0.125"}, tmp_path / "t")
    assert good["stage"] == "full" and good["accuracy"]["complete"]


def test_cascade_stops_are_told_infeasible_so_the_sampler_learns_and_the_frontier_skips_them(tmp_path):
    cfg = _cfg(tmp_path, trials=18)  # 10 seeded trials, then sampled ones
    run_search(cfg, SyntheticEvaluator(cfg))
    flows = open_flows(cfg, create=False)
    stopped = 0
    for study in flows.studies.values():
        for t in study.get_trials(states=(TrialState.COMPLETE,)):
            stage = t.user_attrs["record"]["stage"]
            assert t.constraints["cascade"] == (0.0 if stage == "full" else 1.0)
            stopped += stage != "full"
            best = {b.number for b in study.best_trials}
            assert stage == "full" or t.number not in best
    assert stopped > 0  # the synthetic landscape has hopeless corners; this seed reaches some


def test_a_crashing_trial_is_recorded_failed_and_the_search_goes_on(tmp_path):
    cfg = _cfg(tmp_path, trials=8, min_accuracy=None)
    ev = SyntheticEvaluator(cfg, fail=lambda p: p.get("block_size") == "4")
    result = run_search(cfg, ev)
    records = trial_records(open_flows(cfg, create=False))
    failed = [r for r in records if r["state"] == "FAIL"]
    assert failed and all(r["failure"] == "RuntimeError: CUDA out of memory (synthetic)" for r in failed)
    assert all(r["params"]["block_size"] == "4" for r in failed)
    assert len(records) == 8 and result["trials"]["failed"] == len(failed) and result["complete"]


class _Interrupting(SyntheticEvaluator):
    def __init__(self, cfg, at: int) -> None:
        super().__init__(cfg)
        self.at = at

    def accuracy(self, flow, params, **kw):
        if len(self.calls) + 1 == self.at:
            self.calls.append(("interrupted", dict(params), 0, 0))
            raise KeyboardInterrupt
        return super().accuracy(flow, params, **kw)


def test_ctrl_c_leaves_a_consistent_study_that_resumes_without_losing_the_trial(tmp_path):
    cfg = _cfg(tmp_path, trials=5)  # fewer than the 10 seeded points: the retry must not wait behind them
    ev = _Interrupting(cfg, at=3)
    with pytest.raises(KeyboardInterrupt):
        run_search(cfg, ev)
    lost = ev.calls[-1]
    flows = open_flows(cfg, create=False)
    trials = [t for s in flows.studies.values() for t in s.get_trials()]
    assert TrialState.RUNNING not in [t.state for t in trials]
    assert len([t for t in trials if t.state == TrialState.WAITING and "retry_of" in t.user_attrs]) == 1
    summary = json.loads((tmp_path / "s" / "frontier.json").read_text())
    assert summary["complete"] is False and summary["stopped"] == "interrupted"
    assert len((tmp_path / "s" / "trials.jsonl").read_text().splitlines()) == 3  # 2 done, 1 interrupted
    again = SyntheticEvaluator(cfg)
    result = run_search(cfg, again)  # the same study: it continues
    records = trial_records(open_flows(cfg, create=False))
    done = [r for r in records if r["state"] == "COMPLETE"]
    assert len(done) == 5 and result["complete"]
    failed = [r for r in records if r["state"] == "FAIL"]
    assert [r["failure"] for r in failed] == ["interrupted (Ctrl-C); enqueued again"]
    assert failed[0]["params"] == lost[1]  # the interrupted trial's record names its point
    redone = [r for r in done if r["flow"] == failed[0]["flow"] and r["number"] > failed[0]["number"]]
    assert redone[0]["params"] == lost[1]  # the next trial of its flow, ahead of its seeds


def test_a_stale_running_trial_is_expired_and_enqueued_again_once(tmp_path):
    cfg = _cfg(tmp_path)
    flows = open_flows(cfg, create=True)
    study = flows.studies["quest"]
    trial = study.ask()  # a worker took it (the defaults) and died
    trial.set_user_attr("heartbeat", 1000.0)
    fresh = flows.studies["block_topk"].ask()
    fresh.set_user_attr("heartbeat", 5000.0)
    assert expire_stale(flows, now=1000.0 + 3600, lease=60 * 60 * 2) == []  # within the lease
    assert expire_stale(flows, now=5000.0 + 60) == ["quest#0"]
    assert expire_stale(flows, now=5000.0 + 60) == []  # told once, enqueued once
    t = study.get_trials()[0]
    assert t.state == TrialState.FAIL and t.user_attrs["retried"] and t.user_attrs["failure"].startswith("expired")
    waiting = [w for w in study.get_trials(states=(TrialState.WAITING,)) if "retry_of" in w.user_attrs]  # not the seeds
    assert len(waiting) == 1 and waiting[0].params == t.params and waiting[0].user_attrs["retry_of"] == 0
    assert flows.studies["block_topk"].get_trials()[0].state == TrialState.RUNNING
    silent = flows.studies["block_topk"].ask()  # its worker stopped before the first heartbeat
    assert expire_stale(flows, now=time.time() + 3 * 3600) == ["block_topk#0", "block_topk#1"]
    assert silent.number == 1
    seeds = [w.number for w in study.get_trials(states=(TrialState.WAITING,)) if "retry_of" not in w.user_attrs]
    assert seeds and min(seeds) < waiting[0].number  # enqueued before it, yet the retry runs first:
    assert ask(study).number == waiting[0].number and study.ask().number == min(seeds)


def test_a_worker_waits_for_the_last_trial_of_a_worker_that_dies_and_runs_it_again(tmp_path):
    """--trials counts running trials: a worker that died in the last one must not take its point
    with it (seen on 2 GPUs, issue #19: 7 of 8 trials finished, the killed one never redone)."""
    cfg = _cfg(tmp_path, trials=3, confirm_samples=1)
    flows = open_flows(cfg, create=True)
    study = flows.studies["quest"]
    orphan = ask(study)  # another worker takes the defaults ...
    params = suggest(orphan, flows.classes["quest"], flows.num_layers, {})
    orphan.set_user_attr("heartbeat", time.time())
    events = []

    def on_event(kind, data):
        events.append((kind, data))
        if kind == "waiting":  # ... and dies once this one has spent the budget: its heartbeat is past the lease
            orphan.set_user_attr("heartbeat", time.time() - LEASE_S - 1)

    run_search(cfg, SyntheticEvaluator(cfg), on_event=on_event)
    records = trial_records(open_flows(cfg, create=False))
    assert [r["state"] for r in records].count("COMPLETE") == 3
    failed = [r for r in records if r["state"] == "FAIL"]
    assert len(failed) == 1 and failed[0]["failure"].startswith("expired")
    assert [r for r in records if r["state"] == "COMPLETE" and r["flow"] == "quest" and r["params"] == params]
    assert ("waiting", {"trials": ["quest#0"], "lease_s": LEASE_S}) in events and ("expired", {"trial": "quest#0"}) in events


def test_running_trials_name_their_point_worker_and_heartbeat(tmp_path):
    """What `search show` adds while a search runs: the trials in flight (finished ones are records)."""
    from sparsetune.tuning.workers import running_trials

    flows = open_flows(_cfg(tmp_path), create=True)
    assert running_trials(flows) == []
    t = ask(flows.studies["block_topk"])
    params = suggest(t, flows.classes["block_topk"], flows.num_layers, {})
    t.set_user_attr("record", {"params": params, "stage": "running"})
    t.set_user_attr("worker", "host:7")
    t.set_user_attr("heartbeat", 1000.0)
    [r] = running_trials(flows, now=1012.5)
    assert (r["trial"], r["params"], r["worker"], r["heartbeat_age_s"], r["role"]) == \
        ("block_topk#0", params, "host:7", 12.5, "defaults")
    flows.studies["block_topk"].tell(t, [0.5, 1.5])
    assert running_trials(flows) == []


def test_no_confirm_defaults_confirms_only_the_frontier_and_keeps_no_time_for_the_defaults(tmp_path):
    cfg = _cfg(tmp_path, confirm_defaults=False, samples=4, confirm_samples=10)
    ev = SyntheticEvaluator(cfg)
    result = run_search(cfg, ev)
    front = {r["trial"] for r in result["frontier"]}
    confirmed = [c for c in ev.calls if c[3] == cfg.seed + CONFIRM_SEED_OFFSET]
    assert front and len(confirmed) == len(front)  # the frontier's points, and no defaults
    records = trial_records(open_flows(cfg, create=False))
    defaults = [r for r in records if r["role"] == "defaults"]
    assert len(defaults) == 2 and all(r["confirm"] is None for r in defaults if f"{r['flow']}#{r['number']}" not in front)
    assert result["against_defaults"] == [] and result["defaults_confirmed"] is False
    left = [r["trial"] for r in result["defaults"] if r["confirmed_accuracy"] is None]
    assert left and against_defaults_lines(result) == [
        f"{', '.join(left)}: not compared (not confirmed on fresh prompts: --no-confirm-defaults)"]
    assert "not compared" in (cfg.run_dir / "frontier.md").read_text()
    # the budget keeps back time for the frontier alone, and says so
    for r in defaults:
        open_flows(cfg, create=False).studies[r["flow"]].set_user_attr(f"confirm:{r['number']}", None)
    flows = open_flows(cfg, create=False)
    assert all(r["role"] != "defaults" for r in to_confirm(trial_records(flows), cfg.min_accuracy, False))
    budget = Budget(cfg.model_copy(update=dict(hours=1.0, trials=None)), time.time())
    budget.durations = [60.0, 3.0]
    with_defaults = confirm_reserve(cfg.model_copy(update=dict(confirm_defaults=True)), flows, budget)
    assert confirm_reserve(cfg, flows, budget) == pytest.approx(with_defaults - 2 * 3.0 * 10 / 4)
    budget.deadline = time.time() + 5
    assert "confirming the frontier needs about" in budget.reason_to_stop(flows, 22.5)
    # not part of what the figures depend on: a resume may turn it on, and its workers read the resume's settings
    open_flows(cfg.model_copy(update=dict(confirm_defaults=True, trials=14)), create=True)
    stored = stored_config(open_storage(cfg.storage_url()), cfg.study)
    assert stored.confirm_defaults is True and stored.trials == 14


def test_a_study_run_with_other_settings_is_refused(tmp_path):
    cfg = _cfg(tmp_path, trials=2)
    run_search(cfg, SyntheticEvaluator(cfg))
    with pytest.raises(SparsetuneError, match=r"study 's' was run with other settings \(context differ\)"):
        open_flows(_cfg(tmp_path, trials=2, context=1024), create=True)
    with pytest.raises(SparsetuneError, match=r"\(dtype differ\)"):  # accuracy in another precision: other figures
        open_flows(_cfg(tmp_path, trials=2, dtype="float32"), create=True)
    open_flows(_cfg(tmp_path, trials=20), create=True)  # more trials or hours: the same search


def test_hours_budget_starts_no_trial_that_cannot_finish(tmp_path):
    cfg = _cfg(tmp_path, trials=None, hours=1.5 / 3600, confirm_samples=1)
    ev = SyntheticEvaluator(cfg, sleep=0.4)
    result = run_search(cfg, ev)
    assert "--hours" in result["stopped"] and 1 <= result["trials"]["finished"] <= 4


def test_the_confirmation_reserve_counts_what_is_left_to_confirm_not_the_engines_load(tmp_path):
    cfg = _cfg(tmp_path, hours=1.0, trials=None, samples=4, confirm_samples=10)
    flows = open_flows(cfg, create=True)
    budget = Budget(cfg, time.time())
    budget.durations = [60.0, 4.0, 2.0, 3.0]  # the first trial loaded the engines
    # nothing run yet: the dense pass on the fresh prompts and one point, at a typical trial each (3 s), x 10/4
    assert confirm_reserve(cfg, flows, budget) == pytest.approx(2 * 3.0 * 10 / 4)
    run_search(cfg.model_copy(update=dict(hours=None, trials=8)), SyntheticEvaluator(cfg))  # confirms what it found
    flows = open_flows(cfg, create=False)
    records = trial_records(flows)
    assert to_confirm(records, cfg.min_accuracy) == [] and any(r["confirm"] for r in records)
    assert confirm_reserve(cfg, flows, budget) == pytest.approx(2 * 3.0 * 10 / 4)  # a resume does not redo them
    # a finished trial not yet confirmed (a new frontier point) adds one typical trial
    study = flows.studies["quest"]
    study.set_user_attr("confirm:0", None)
    assert len(to_confirm(trial_records(flows), cfg.min_accuracy)) == 1
    assert confirm_reserve(cfg, flows, budget) == pytest.approx(3 * 3.0 * 10 / 4)
    # the budget's reason to stop says how much of the time left is the confirmation's
    budget.deadline = time.time() + 20.3
    assert re.fullmatch(r"--hours 1 spent \(no trial fits in the (20|19) s left: confirming the frontier and the "
                        r"defaults needs about 22 s\)", budget.reason_to_stop(flows, 22.5))
    assert budget.reason_to_stop(flows, 0.0) is None  # a 4 s trial fits in 20 s


def test_optuna_storage_is_one_study_per_flow(tmp_path):
    cfg = _cfg(tmp_path, trials=3)
    run_search(cfg, SyntheticEvaluator(cfg))
    storage = open_flows(cfg, create=False).studies["quest"]._storage
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(storage))
    assert names == ["s/block_topk", "s/quest"]
    study = open_flows(cfg, create=False).studies["quest"]
    assert study.metric_names == ["relative_accuracy", "speedup"] and len(study.directions) == 2


def test_trials_failing_in_a_row_stop_the_search_with_the_reason(tmp_path):
    cfg = _cfg(tmp_path, trials=None, hours=1.0)
    result = run_search(cfg, SyntheticEvaluator(cfg, fail=lambda p: True))
    assert result["stopped"] == "5 trials in a row failed (last: RuntimeError: CUDA out of memory (synthetic))"
    assert result["trials"]["failed"] == 5 and result["trials"]["finished"] == 0


def test_sparsetune_search_is_the_python_api(tmp_path):
    import sparsetune
    import sparsetune.tuning.run  # noqa: F401  (the package stays callable once its modules are loaded)

    cfg = _cfg(tmp_path, trials=3)
    out = sparsetune.search("quest,block_topk", evaluator=SyntheticEvaluator(cfg), study="s", out=str(tmp_path),
                            trials=3, context=2048, min_accuracy=0.9, confirm_samples=2)
    assert out["study"] == "s" and out["trials"]["finished"] == 3 and out["complete"]
    with pytest.raises(SparsetuneError, match="--resume: no search 'new'"):
        sparsetune.search("quest", resume=True, study="new", out=str(tmp_path))
    with pytest.raises(SparsetuneError, match="--resume: no search 'new'"):  # refused: nothing written
        sparsetune.search("quest", resume=True, study="new", out=str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()


def test_a_confirmed_point_holds_unless_fresh_prompts_put_it_below_the_bar_or_its_search_figure():
    from sparsetune.tuning.confirm import confirmation

    fresh = {"relative_accuracy": 0.8, "accuracy": 0.4, "dense_accuracy": 0.5, "samples": 40}
    lo, hi = confirmation(fresh, {"relative_accuracy": 0.9}, None)["interval"]
    assert 0 < lo < 0.8 < hi < 1.2  # Wilson on 16 of 40, over dense
    assert confirmation(fresh, {"relative_accuracy": 0.5}, None)["holds"]  # fresh prompts did better
    assert confirmation(fresh, {"relative_accuracy": hi - 0.01}, None)["holds"]
    assert not confirmation(fresh, {"relative_accuracy": hi + 0.01}, None)["holds"]
    assert not confirmation(fresh, {"relative_accuracy": 0.8}, 0.95)["holds"]  # below the bar
    assert confirmation({**fresh, "relative_accuracy": 0.96}, {"relative_accuracy": 1.1}, 0.95)["holds"]


class LuckyOnSmallBudgets(SyntheticEvaluator):
    """Points below 1/4 of the context look fine on the search set and lose 30 points on fresh prompts."""

    def accuracy(self, flow, params, *, samples, seed, out, on_chunk=None):
        acc = super().accuracy(flow, params, samples=samples, seed=seed, out=out, on_chunk=on_chunk)
        if seed != self.cfg.seed and float(params.get("budget_ratio", 1)) < 0.25:
            acc = dataclasses.replace(acc, relative=round(acc.relative - 0.3, 4), accuracy=round(acc.accuracy - 0.15, 4))
        return acc


def test_confirmation_goes_on_until_every_frontier_point_left_has_held(tmp_path):
    from sparsetune.tuning.confirm import confirm
    from sparsetune.tuning.run import work

    cfg = _cfg(tmp_path, trials=16, min_accuracy=0.8)
    ev = LuckyOnSmallBudgets(cfg)
    flows = open_flows(cfg, create=True)
    work(cfg, flows, ev, Budget(cfg, time.time()))
    first = {(r["flow"], r["number"]) for r in to_confirm(trial_records(flows), cfg.min_accuracy)}
    confirm(cfg, flows, ev, deadline=0.0)  # past the deadline: the first round only
    records = trial_records(flows)
    assert {(r["flow"], r["number"]) for r in records if r.get("confirm")} == first
    exposed = to_confirm(records, cfg.min_accuracy)  # what the points that did not hold dominated
    assert exposed and not {(r["flow"], r["number"]) for r in exposed} & first
    confirm(cfg, flows, ev)  # until nothing is left to confirm
    records = trial_records(flows)
    assert to_confirm(records, cfg.min_accuracy) == []
    from sparsetune.tuning.report import summary

    s = summary(cfg, records, complete=True, stopped=None)
    assert s["confirmed_frontier"] and all(r["holds"] for r in s["confirmed_frontier"])
    assert all(float(r["params"]["budget_ratio"]) >= 0.25 for r in s["confirmed_frontier"])
    assert s["not_confirmed"] and all(float(r["params"]["budget_ratio"]) < 0.25 for r in s["not_confirmed"])
    assert {(r["flow"], r["number"]) for r in exposed} <= {(r["flow"], r["number"]) for r in records if r.get("confirm")}


@pytest.mark.tuned_defaults
def test_save_defaults_makes_each_flows_fastest_confirmed_point_the_models_default(tmp_path, monkeypatch):
    from sparsetune.setup import tuned_defaults
    from sparsetune.models.artifacts import read_tuned_defaults

    monkeypatch.setenv("SPARSETUNE_MODELS", str(tmp_path / "models"))  # the user's defaults file goes here
    with pytest.raises(SparsetuneError, match="--save-defaults needs --min-accuracy"):
        _cfg(tmp_path, min_accuracy=None, save_defaults=True)
    cfg = _cfg(tmp_path, trials=16, min_accuracy=0.9, save_defaults=True)
    result = run_search(cfg, SyntheticEvaluator(cfg))
    saved = {d["flow"]: d for d in result["saved_defaults"]}
    assert json.loads((tmp_path / "s" / "frontier.json").read_text())["saved_defaults"] == result["saved_defaults"]
    for key in ("quest", "block_topk"):
        held = [r for r in result["confirmed_frontier"] if r["flow"] == key and r["confirmed_accuracy"] >= 0.9]
        if not held:
            assert not saved[key]["saved"] and "no confirmed point" in saved[key]["reason"]
            continue
        best = max(held, key=lambda r: r["speedup"])  # the fastest point that kept the bar on fresh prompts
        assert saved[key]["saved"] and saved[key]["trial"] == best["trial"]
        entry = read_tuned_defaults("smollm2-135m")[key]
        assert entry["params"] == best["params"] and entry["source"]["study"] == "s"
        assert entry["source"]["trial"] == best["trial"] and entry["source"]["confirmed_accuracy"] >= 0.9
        assert tuned_defaults("smollm2-135m", False, key, {})[0] == best["params"]
    assert any(d["saved"] for d in saved.values())


class _FailsToConfirm(SyntheticEvaluator):
    """The first point confirmed runs out of memory (the search's 8K lease on an H200, #43)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.failed: list[dict] = []

    def accuracy(self, flow, params, *, samples, seed, out, on_chunk=None):
        if seed != self.cfg.seed and not self.failed:
            self.failed.append(dict(params))
            raise RuntimeError("CUDA out of memory. Tried to allocate 548.00 MiB\n(more lines)")
        return super().accuracy(flow, params, samples=samples, seed=seed, out=out, on_chunk=on_chunk)


def test_a_point_whose_confirmation_fails_is_recorded_and_the_others_are_confirmed(tmp_path):
    from sparsetune.tuning.confirm import confirm

    cfg = _cfg(tmp_path, trials=8)
    ev = _FailsToConfirm(cfg)
    events = []
    result = run_search(cfg, ev, on_event=lambda kind, data: events.append((kind, data)))
    records = trial_records(open_flows(cfg, create=False))
    errored = [r for r in records if (r.get("confirm") or {}).get("error")]
    assert len(errored) == 1 and errored[0]["params"] == ev.failed[0]
    assert errored[0]["confirm"] == {"holds": False, "error": "RuntimeError: CUDA out of memory. Tried to allocate 548.00 MiB"}
    assert [d["reason"] for k, d in events if k == "confirm_failed"] == [errored[0]["confirm"]["error"]]
    assert result["complete"] and result["confirmed_frontier"]  # the others were confirmed
    name = f"{errored[0]['flow']}#{errored[0]['number']}"
    assert [r["trial"] for r in result["confirm_failed"]] == [name]
    assert name not in {r["trial"] for r in result["confirmed_frontier"]}
    assert f"- {name}: RuntimeError: CUDA out of memory" in (cfg.run_dir / "frontier.md").read_text()
    # a resumed search tries it again
    flows = open_flows(cfg, create=False)
    confirm(cfg, flows, ev)
    again = next(r for r in trial_records(flows) if (r["flow"], r["number"]) == (errored[0]["flow"], errored[0]["number"]))
    assert again["confirm"].get("error") is None and again["confirm"]["relative_accuracy"] is not None


class _NeverConfirms(SyntheticEvaluator):
    def accuracy(self, flow, params, *, samples, seed, out, on_chunk=None):
        if seed != self.cfg.seed:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().accuracy(flow, params, samples=samples, seed=seed, out=out, on_chunk=on_chunk)


def test_confirmations_failing_one_after_another_stop_the_search_and_keep_the_study(tmp_path):
    from sparsetune.tuning.policy import FAILURES_IN_A_ROW

    cfg = _cfg(tmp_path, trials=12, min_accuracy=0.5)
    with pytest.raises(SparsetuneError, match=f"{FAILURES_IN_A_ROW} confirmations in a row failed .*illegal memory access.*--resume"):
        run_search(cfg, _NeverConfirms(cfg))
    records = trial_records(open_flows(cfg, create=False))
    assert len([r for r in records if (r.get("confirm") or {}).get("error")]) == FAILURES_IN_A_ROW
    assert len(records) == 12 and "stopped: confirmation failed." in (cfg.run_dir / "frontier.md").read_text()  # kept
