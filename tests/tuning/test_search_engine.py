"""A real search on the embedded model (CPU): one engine for every trial (block-size changes lay
its pool out anew, the weights stay), dense computed once per prompt set, each trial's figures
those `sparsetune eval` gives for its params; and the CLI end to end with --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsetune.evaluation.config import EvalConfig
from sparsetune.evaluation.runner import evaluate
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.run import run_search
from sparsetune.tuning.studies import open_flows, trial_records
from sparsetune.tuning.trial import EngineEvaluator
from helpers import run

SMALL = dict(model="smollm2-135m", tasks=("niah_single",), context=256, samples=2, batch=4, confirm_samples=1)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_trials_share_one_engine_and_match_sparsetune_eval(tmp_path):
    cfg = SearchConfig(study="e", out=str(tmp_path), flows=("quest",), trials=3, device="cpu", **SMALL)
    ev = EngineEvaluator(cfg)
    run_search(cfg, ev)
    llm = ev.llm
    records = [r for r in trial_records(open_flows(cfg, create=False)) if r.get("accuracy")]
    assert len(records) >= 2 and {r["params"]["block_size"] for r in records} >= {"16", "4"}  # defaults, then TPE's
    assert set(ev.references) == {(2, 0), (1, 1000)}  # the search set and the confirmation set: dense once each
    # A trial's figures are the ones a standalone eval of its params gives
    rec = records[-1]
    alone = evaluate(EvalConfig.of(flow="quest", params=rec["params"], tasks=SMALL["tasks"], context=256, samples=2,
                                   batch=4, mode="accuracy", device="cpu"), out=tmp_path / "alone")
    alone = alone.dump()
    assert (alone["relative_accuracy"], alone["fidelity"]) == (rec["accuracy"]["relative_accuracy"], rec["accuracy"]["fidelity"])
    assert ev.llm is llm and rec["speed"]["kind"] == "modeled"
    # modeled with the shipped GPU costs, on the speed shape, with the fields' memory beside it
    from sparsetune.loader import build_flow
    from sparsetune.models.registry import REGISTRY
    from sparsetune.perf.cost import field_memory_share, modeled_speedup

    point, qwen = build_flow("quest", rec["params"]), REGISTRY["qwen3-8b"].config  # the costs' shape: no --speed-* given
    assert rec["speed"]["costs"] == "NVIDIA H200" and "H200" in rec["speed"]["what"]
    assert (rec["speed"]["model"], rec["speed"]["batch"], rec["speed"]["context"]) == ("qwen3-8b", 16, 32768)
    assert rec["speed"]["speedup"] == round(modeled_speedup(qwen, point, 16, 32768), 4)
    assert rec["speed"]["field_memory_share"] == round(field_memory_share(qwen, point), 4)
    # The trial's record holds its setup, the value a re-run of the point resolves to from the command line
    from sparsetune.api import resolve_options
    from sparsetune.cli.options import setup_options
    from sparsetune.setup import Setup

    cli = resolve_options(**setup_options("smollm2-135m", flow="quest", param=[f"{k}={v}" for k, v in rec["params"].items()],
                                          device="cpu", defaults="published"))
    assert Setup.from_dict(rec["accuracy"]["setup"]) == cli


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_the_cascade_stops_a_trial_on_the_figures_the_evaluation_hands_over(tmp_path, monkeypatch):
    """The evaluation hands each chunk's partial results to the evaluator in process; a `Hopeless`
    after the first chunk returns those figures without reading results.json back (it is written,
    for a resume, with the same figures)."""
    from sparsetune.evaluation.results import EvalResult
    from sparsetune.tuning.protocols import Hopeless

    cfg = SearchConfig(study="c", out=str(tmp_path), flows=("quest",), device="cpu", **{**SMALL, "batch": 1})
    seen = []

    def hopeless(partial):
        seen.append(partial)
        raise Hopeless("below the floor")

    with monkeypatch.context() as m:
        m.setattr(EvalResult, "read", classmethod(lambda cls, path: pytest.fail(f"read back {path}")))
        acc = EngineEvaluator(cfg).accuracy("quest", {}, samples=2, seed=0, out=tmp_path / "t", on_chunk=hopeless)
    assert [p["samples_done"] for p in seen] == [1] and seen[0]["samples_total"] == 2  # a chunk of batch 1, not the last
    assert not acc.complete and acc.samples == 1 and acc.relative == seen[0]["relative_accuracy"]
    on_disk = EvalResult.read(acc.run_dir).dump()
    assert (on_disk["samples_done"], on_disk["relative_accuracy"], on_disk["complete"]) == (1, acc.relative, False)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_search_cli_prints_the_frontier_as_json_and_the_trials_as_it_goes(tmp_path):
    proc = run("search", "--flow", "block_topk", "--task", "niah_single", "--context", "256", "--samples", "1",
               "--confirm-samples", "1", "--batch", "4", "--trials", "2", "--study", "cli", "--out", str(tmp_path),
               "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["study"] == "cli" and out["speed"] == "modeled" and out["trials"]["finished"] == 2
    assert out["defaults"][0]["params"]["block_size"] == "16" and out["defaults"][0]["confirmed_accuracy"] is not None
    assert "trial block_topk#0 (defaults)" in proc.stderr and "speedup" in proc.stderr
    shown = run("search", "show", str(Path(tmp_path) / "cli"), "--json")
    assert shown.returncode == 0 and len(json.loads(shown.stdout)["records"]) == 2


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_a_reuse_search_measures_what_sparsetune_eval_measures(tmp_path):
    """--reuse: a trial is the reuse flow's evaluation on prompts with segments, relative to dense
    (full prefill) on the same prompts, and its modeled speed is a full prefill's token-layers over
    the ones that evaluation computed."""
    cfg = SearchConfig(kind="reuse", study="r", out=str(tmp_path), flows=("cacheblend",), trials=2, device="cpu",
                       model="smollm2-135m", tasks=("rag",), context=384, samples=2, batch=2, confirm_samples=1)
    result = run_search(cfg, EngineEvaluator(cfg))
    records = [r for r in trial_records(open_flows(cfg, create=False)) if r.get("accuracy")]
    assert len(records) == 2 and records[0]["role"] == "defaults" and records[0]["params"]["check_layer"] == "1"
    rec = records[-1]
    alone = evaluate(EvalConfig.of(reuse="cacheblend", reuse_params=rec["params"], tasks=("rag",), context=384, samples=2,
                                   batch=2, mode="accuracy", device="cpu"), out=tmp_path / "alone").dump()
    fraction = alone["reuse"]["compute_fraction"]
    assert alone["relative_accuracy"] == rec["accuracy"]["relative_accuracy"] and 0 < fraction < 1
    assert rec["speed"] == {**rec["speed"], "kind": "modeled", "speedup": round(1 / fraction, 4), "compute_fraction": fraction}
    assert result["kind"] == "reuse" and result["share_of"] == "token-layers computed"
    assert {r["trial"]: r["share"] for r in result["defaults"]} == {"cacheblend#0": records[0]["accuracy"]["reuse"]["compute_fraction"]}
    assert result["defaults"][0]["confirmed_accuracy"] is not None


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_measured_reuse_speed_times_full_recompute_and_the_flow_alternately(tmp_path, monkeypatch):
    """--speed measured for reuse flows (what a GPU does; here on CPU): the segments stored once,
    then full recompute and the flow timed alternately on the same prompt, the speedup the ratio of
    the medians, and the flow's recompute plan the one its stats report."""
    from sparsetune.tuning.trial import REUSE_SPEED_REPEATS

    cfg = SearchConfig(kind="reuse", study="m", out=str(tmp_path), flows=("cacheblend",), device="cpu", speed="measured",
                       model="smollm2-135m", tasks=("rag",), context=512, batch=2)
    ev = EngineEvaluator(cfg)
    speedup, info = ev.speedup("cacheblend", {"ratio": "0.1", "check_layer": "2"})
    flow, full = info["flow_ttft_runs_ms"], info["full_ttft_runs_ms"]
    assert len(flow) == len(full) == REUSE_SPEED_REPEATS
    assert info["flow_ttft_ms"] == sorted(flow)[len(flow) // 2] and info["full_ttft_ms"] == sorted(full)[len(full) // 2]
    # the ratio of the unrounded medians, to 4 places (the reported ms are rounded to 3: the last place may differ)
    assert abs(speedup - info["full_ttft_ms"] / info["flow_ttft_ms"]) <= 1e-4
    assert info["kind"] == "measured" and info["model"] == "smollm2-135m" and not info["random_weights"]
    # cacheblend at check layer 2 of 30 recomputes every token in layers 0-1, then 10% of the reused ones
    assert 2 / 30 < info["compute_fraction"] < 2 / 30 + 0.2
    assert abs(info["prompt_tokens"] - 512) < 0.15 * 512  # --speed-context in the model's own tokens
    assert info["segment_hits"] == 9  # every segment of the timed prompt came from the cache (stage 1)
    ev.take_turns = True  # engines taking turns (they did not fit together): a new speed engine stores them again
    ev.llm
    assert ev._speed_llm is None
    _, again = ev.speedup("cacheblend", {"ratio": "0.1", "check_layer": "2"})
    assert again["segment_hits"] == 9 and again["compute_fraction"] == info["compute_fraction"]
    # storing the segments runs out of memory beside the accuracy engine: stored again, on the engine kept
    import sparsetune.perf.speed as speed
    from sparsetune.errors import OutOfMemory

    ev2, stores = EngineEvaluator(cfg), []
    ev2.llm
    monkeypatch.setattr(speed, "store_segments", _fails_once(speed.store_segments, lambda: OutOfMemory(
        "the KV pool needs 2.1 GiB but free GPU memory is 1.9 GiB (synthetic)"), stores, lambda: ev2._llm is not None))
    _, third = ev2.speedup("cacheblend", {"ratio": "0.1", "check_layer": "2"})
    assert stores == [True, False] and ev2.take_turns and third["segment_hits"] == 9
    assert not ev2._speed_llm.engine.scheduler.has_work()


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_workers_2_runs_the_study_in_two_processes(tmp_path):
    """--workers 2 on CPU: a `search worker` process beside this one (the cores split), both on the
    run folder's journal: every trial once, both processes run trials, then one confirmation."""
    proc = run("search", "--flow", "block_topk", "--task", "niah_single", "--context", "256", "--samples", "1",
               "--confirm-samples", "1", "--batch", "4", "--trials", "6", "--workers", "2", "--study", "w",
               "--out", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["trials"]["finished"] + out["trials"]["failed"] == 6 and out["trials"]["failed"] == 0
    records = json.loads(run("search", "show", str(tmp_path / "w"), "--json").stdout)["records"]
    assert len({(r["flow"], r["number"]) for r in records}) == len(records) == 6
    assert len({r["worker"] for r in records}) == 2  # this process and the spawned one
    log = tmp_path / "w" / "workers" / "w1.log"
    assert "finished (its log: " + str(log) in proc.stderr and "trial block_topk#" in log.read_text()
    assert out["defaults"][0]["confirmed_accuracy"] is not None


def _fails_once(fn, error, seen: list, held):
    """`fn`, except that its first call raises `error()` (a new one: a kept exception's traceback
    would keep the failed step's engine alive); each call records `held()` (whether the other
    engine was held then) in `seen`."""
    def wrapper(*a, **kw):
        seen.append(held())
        if len(seen) == 1:
            raise error()
        return fn(*a, **kw)

    return wrapper


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_engines_that_do_not_fit_together_take_turns_after_running_out_of_memory(tmp_path, monkeypatch):
    """An 8K accuracy context beside a 16 x 32K speed shape does not fit on one H200 (BENCHMARKS.md,
    #43): the step that ran out of memory runs again with the other engine dropped (its KV pool given
    back), and from then on each engine is built when its step comes."""
    import gc
    import weakref

    import torch

    import sparsetune.evaluation.runner as runner
    import sparsetune.llm as llm_module
    import sparsetune.perf.speed as speed
    from sparsetune.errors import OutOfMemory

    cfg = SearchConfig(study="m", out=str(tmp_path), flows=("quest",), trials=3, device="cpu", speed="measured",
                       speed_batch=2, speed_context=128, **SMALL)
    events = []
    ev = EngineEvaluator(cfg, on_event=lambda kind, data: events.append((kind, data)))
    params = {"block_size": "16", "budget_ratio": "0.5"}
    first = ev.accuracy("quest", params, samples=2, seed=0, out=tmp_path / "a")  # both engines held, as before
    ev.speedup("quest", params)
    assert ev._llm is not None and ev._speed_llm is not None and not ev.take_turns
    speed_pool = weakref.ref(ev._speed_llm.engine.kv.k)
    evaluate_once, calls = runner.evaluate, []
    # the prefill's activations no longer fit beside the speed engine
    monkeypatch.setattr(runner, "evaluate", _fails_once(evaluate_once, lambda: torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 548.00 MiB (synthetic)"), calls, lambda: ev._speed_llm is not None))
    again = ev.accuracy("quest", params, samples=2, seed=0, out=tmp_path / "b")
    assert calls == [True, False] and ev.take_turns and ev._speed_llm is None
    assert events == [("turns", {"reason": "OutOfMemoryError: CUDA out of memory. Tried to allocate 548.00 MiB (synthetic)"})]
    assert all(r.host for r in ev.references.values())  # the stored prompt KV leaves the GPU to the engines
    gc.collect()
    assert speed_pool() is None  # its memory went back
    assert (again.relative, again.fidelity) == (first.relative, first.fidelity)  # the step ran again, whole
    acc_pool = weakref.ref(ev._llm.engine.kv.k)
    speedup, info = ev.speedup("quest", params)
    assert ev._llm is None and ev._speed_llm is not None and acc_pool() is None and info["kind"] == "measured"
    ev.accuracy("quest", params, samples=2, seed=0, out=tmp_path / "c")
    assert ev._speed_llm is None and ev._llm is not None and len(events) == 1  # said once
    # a failure that is not about memory is not taken for one
    ev2 = EngineEvaluator(cfg)
    ev2.speedup("quest", params)
    monkeypatch.setattr(runner, "evaluate", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        ev2.accuracy("quest", params, samples=2, seed=0, out=tmp_path / "d")
    assert not ev2.take_turns and ev2._speed_llm is not None
    # the speed engine's pool not fitting beside the accuracy engine: the same, the other way round
    steps = []
    monkeypatch.setattr(speed, "decode_step_seconds", _fails_once(speed.decode_step_seconds, lambda: OutOfMemory(
        "the KV pool needs 91.9 GiB but free GPU memory is 86.4 GiB (synthetic)"), steps, lambda: ev2._llm is not None))
    assert ev2._llm is not None and ev2._speed_llm is not None
    _, info = ev2.speedup("quest", params)
    assert steps[:2] == [True, False] and ev2.take_turns and ev2._llm is None and info["kind"] == "measured"
    # the accuracy engine's own pool not fitting beside the speed engine (raised while it is built)
    ev3 = EngineEvaluator(cfg)
    ev3.speedup("quest", params)
    built = []
    monkeypatch.setattr(llm_module, "LLM", _fails_once(llm_module.LLM, lambda: OutOfMemory(
        "the KV pool needs 27.5 GiB but free GPU memory is 20.1 GiB (synthetic)"), built, lambda: ev3._speed_llm is not None))
    monkeypatch.setattr(runner, "evaluate", evaluate_once)
    got = ev3.accuracy("quest", params, samples=2, seed=0, out=tmp_path / "e")
    assert built == [True, False] and ev3.take_turns and ev3._speed_llm is None
    assert (got.relative, got.fidelity) == (first.relative, first.fidelity)


def test_a_speed_on_another_architecture_is_the_same_points_channel_share(tmp_path):
    """DoubleSparse's label channels are a share of the head (r = head_dim / group factor): a point
    whose accuracy ran at 32 of the embedded model's 64 channels is timed on Qwen3-8B at 64 of 128,
    not at a quarter of its head; flows with no such param are timed as they ran."""
    from sparsetune.loader import build_flow
    from sparsetune.models.registry import REGISTRY
    from sparsetune.perf.cost import field_memory_share, modeled_speedup

    cfg = SearchConfig(study="h", out=str(tmp_path), flows=("double_sparse_2l", "quest"), device="cpu", speed="modeled",
                       speed_model="qwen3-8b", speed_batch=16, speed_context=32768, **SMALL)
    ev, qwen = EngineEvaluator(cfg), REGISTRY["qwen3-8b"].config
    params = {"channels": "32", "budget_ratio": "0.1", "coarse": "2"}
    speedup, info = ev.speedup("double_sparse_2l", params)
    there = build_flow("double_sparse_2l", {**params, "channels": "64"})
    assert info["params"] == {**params, "channels": "64"}
    assert speedup == round(modeled_speedup(qwen, there, 16, 32768), 4)
    assert info["field_memory_share"] == round(field_memory_share(qwen, there), 4)
    assert speedup != round(modeled_speedup(qwen, build_flow("double_sparse_2l", params), 16, 32768), 4)
    assert ev._llm is None and ev._speed_llm is None  # modeled: no engine
    _, quest = ev.speedup("quest", {"budget_ratio": "0.1"})
    assert "params" not in quest
    # the rule itself: the share kept both ways, the nearest value the param accepts (on a tie the larger, the
    # slower), at most the head
    from sparsetune.flow.base import on_head_dim

    flow = build_flow("double_sparse", {"channels": "16"})
    assert on_head_dim(flow, {"channels": "16"}, 128, 64) == {"channels": "8"}
    assert on_head_dim(flow, {"channels": "16"}, 64, 64) == {"channels": "16"}
    assert on_head_dim(build_flow("double_sparse", {"channels": "4"}), {}, 128, 16) == {"channels": "4"}  # 1: not a choice
    assert on_head_dim(build_flow("double_sparse", {"channels": "64"}), {}, 64, 80) == {"channels": "64"}  # 80: not one
    assert on_head_dim(build_flow("double_sparse", {"channels": "16"}), {}, 64, 96) == {"channels": "32"}  # 24: a tie
    from sparsetune.flow import Param

    class Ranged(type(flow)):  # a channel count by range, not choices: kept inside it
        channels = Param(16, low=4, high=64, doc="label channels")

    assert on_head_dim(Ranged(channels=64), {}, 64, 128) == {"channels": "64"}
    assert on_head_dim(Ranged(channels=4), {}, 128, 64) == {"channels": "4"}
    assert on_head_dim(Ranged(channels=24), {}, 64, 128) == {"channels": "48"}
