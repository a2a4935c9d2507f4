"""The search loop: trials of every flow's study on one engine, a merged frontier, confirmation.

A worker (the `search` command itself, or `search worker` joining it) repeats: expire stale
trials, pick a flow, `ask` its study, run the trial's cascade, `tell` the result, rewrite the run
folder's files. The coordinator then re-evaluates the frontier on fresh prompts.

**Allocation between flows.** Each flow's study starts with its seeds (enqueued, `seed_trials`:
the defaults, then each categorical's other levels at the defaults), the flows interleaved, and
gets trials round-robin until every flow has `WARM_TRIALS`; after that each trial goes to the flow with
the largest share of the merged frontier's hypervolume (the area only its points cover), ties to
the flow with fewer trials, and every third trial still round-robin. A flow whose points are all
dominated stops drawing trials except the round-robin ones, so no flow is written off on a few
noisy early trials.

**The cascade** (multi-objective studies cannot prune): (1) speed first, from the cost model or
the GPU: a point not faster than dense (speedup <= 1) cannot be on the frontier and stops there
(a reuse flow's modeled speed is what its evaluation computed, so it comes after (2) and (3));
(2) accuracy on the first chunk of samples: below `quick_floor` x the bar (min-accuracy, or dense)
it stops; (3) the rest of the samples. Stopped trials are told with the figures they have and a
violated "cascade" constraint, so the sampler learns from them and the frontier never holds them.

**Time, failure, resume.** No trial starts that cannot finish before `--hours` runs out (the
slowest trial so far, after the first, which pays for loading engines and the dense pass, is the
estimate; time to confirm the frontier and the defaults is kept back). A trial that raises
is told FAIL with its reason (five in a row stop the search: the engine, not the point, is
broken). Ctrl-C stops the running trial, tells it FAIL ("interrupted") and
enqueues its params again, so a resumed study redoes it. A RUNNING trial whose heartbeat is older
than the lease (a killed worker) is told FAIL and its params enqueued again, once, by whichever
worker sees it first (the tell is the lock). Such a retry is the next trial its flow runs, ahead of
enqueued seeds (`ask`): under `--trials` it is not left waiting when the budget is spent. A
worker that finds `--trials` spent while other workers' trials still run waits for them before it
leaves: the budget counts running trials, so a worker that died in the last one would otherwise
take its point with it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.sandbox import IsolationRefused
from sparsetune.tuning.config import MASK, SearchConfig, flow_key, masked_url, resume_command
from sparsetune.tuning.frontier import eligible, hypervolume, point_of, search_frontier, trial_name, wilson_interval
from sparsetune.tuning.space import dimensions, suggest
from sparsetune.tuning.storage import (open_storage, record_of, stored_config, study_name,
                                       trial_count)

WARM_TRIALS = 4
STARTUP_TRIALS = 2  # random trials per flow's study, after the seeded ones (`seed_trials`)
FAILURES_IN_A_ROW = 5  # then the search stops: something other than the points is wrong
CONFIRM_SEED_OFFSET = 1000
HEARTBEAT_S = float(os.environ.get("SPARSETUNE_HEARTBEAT_S", "20"))
LEASE_S = 6 * HEARTBEAT_S
WAIT_S = min(5.0, HEARTBEAT_S / 4)  # how often a worker with nothing left to start looks at the others' trials
DEFAULT_BUDGET_RATIO = 0.125  # the defaults' budget, as a share of the context (the search's budget coordinate)

EventFn = Callable[[str, dict[str, Any]], None]


@dataclass
class Studies:
    """The search's flows by key: each one's study, its class (what `suggest` reads), the flow as
    a trial runs it (a built-in name or a file), the model's number of layers. `foreign`: flows
    added at runtime by a proposer (`agents.loop`): their failures are theirs, not the engine's."""

    studies: dict[str, optuna.Study]
    classes: dict[str, type]
    num_layers: int
    args: dict[str, str] = field(default_factory=dict)
    foreign: set[str] = field(default_factory=set)


def _num_layers(model: str) -> int:
    from sparsetune.models.resolve import model_config

    return model_config(model, False)[1].num_hidden_layers


def default_trial_params(cls: type, num_layers: int, fixed: dict[str, str]) -> dict[str, Any]:
    """A flow's defaults as values of its search dimensions (layer sets as their size; a fixed
    token budget as `DEFAULT_BUDGET_RATIO` of the context)."""
    from optuna.distributions import CategoricalDistribution

    specs, out = cls.param_specs(), {}
    for dim in dimensions(cls, num_layers):
        if dim.name in fixed:
            continue
        default = specs[dim.name].default
        if default is None and dim.default is not None:  # a layer its flow derives from the model
            default = dim.default
        if dim.layers is not None:
            value: Any = len(default or ())
        elif dim.name == "budget_ratio" and default is None:
            value = DEFAULT_BUDGET_RATIO
        else:
            value = default
        d = dim.distribution
        ok = value in d.choices if isinstance(d, CategoricalDistribution) else (
            value is not None and d.low <= value <= d.high)
        if ok:
            out[dim.name] = value
    return out


def seed_trials(cls: type, num_layers: int, fixed: dict[str, str]) -> list[tuple[dict[str, Any], str]]:
    """What a flow's study runs before sampling: its defaults, then every other choice of each
    categorical dimension with the rest at the defaults (one factor at a time). Random startup
    trials rarely cover a categorical's every level, and a level can change everything (blocks of
    2 tokens against 16 on a head-dimension-64 model), so each is measured once."""
    from optuna.distributions import CategoricalDistribution

    base = default_trial_params(cls, num_layers, fixed)
    out: list[tuple[dict[str, Any], str]] = [(base, "defaults")]
    for dim in dimensions(cls, num_layers):
        if dim.name in fixed or dim.name not in base or not isinstance(dim.distribution, CategoricalDistribution):
            continue
        out += [({**base, dim.name: c}, "sweep") for c in dim.distribution.choices if c != base[dim.name]]
    return out


def open_flows(cfg: SearchConfig, *, create: bool) -> Studies:
    """Every flow's study in the search's storage; `create`: make missing ones (the coordinator),
    each seeded with its defaults, and refuse a stored search whose figures depend on other settings."""
    from sparsetune.loader import get_flow_class
    from sparsetune.reuse.base import ReuseFlow

    storage = open_storage(cfg.storage_url(), create=create)
    stored = stored_config(storage, cfg.study)
    if stored is not None and stored.fingerprint() != cfg.fingerprint():
        diff = [k for k, v in cfg.fingerprint().items() if stored.fingerprint().get(k) != v]
        raise SparsetuneError(f"study {cfg.study!r} was run with other settings ({', '.join(diff)} differ); "
                              f"rerun with the same ones, or pass a new --study name")
    flows = Studies({}, {}, _num_layers(cfg.model))
    for flow in cfg.flows:
        cls = get_flow_class(flow, ReuseFlow) if cfg.kind == "reuse" else get_flow_class(flow)
        add_flow(cfg, flows, flow, cls, storage=storage, create=create)
    return flows


def fixed_params(cfg: SearchConfig, cls: type) -> dict[str, str]:
    """The `--param`s a flow takes (a built-in flow takes all, `check_search`; a proposed one those it declares)."""
    specs = cls.param_specs()
    return {k: v for k, v in cfg.params.items() if k in specs}


def add_flow(cfg: SearchConfig, flows: Studies, flow: str, cls: type, *, storage=None, create: bool,
             foreign: bool = False) -> str:
    """Open (`create`: or make, seeded with `seed_trials`) the study of `flow` (a name or a file)
    and add it to `flows`; returns its key."""
    from optuna.samplers import TPESampler

    key, name = flow_key(flow), study_name(cfg.study, flow)
    storage = storage if storage is not None else next(iter(flows.studies.values()))._storage
    seeds = seed_trials(cls, flows.num_layers, fixed_params(cfg, cls))
    if foreign:  # a proposed flow starts at its defaults; its short study samples the rest
        seeds = seeds[:1]
    # TPE (Optuna 5's multi-objective default) after the seeded trials and STARTUP_TRIALS random
    # ones, not its 10: a search of tens of trials over several flows would otherwise be mostly random.
    sampler = TPESampler(seed=cfg.seed + len(flows.studies) + (os.getpid() if not create else 0),
                         n_startup_trials=len(seeds) + STARTUP_TRIALS)
    if create:
        study = optuna.create_study(study_name=name, storage=storage, directions=["maximize", "maximize"],
                                    sampler=sampler, load_if_exists=True)
        if "search" not in study.user_attrs:
            with warnings.catch_warnings():  # experimental in Optuna 5, and only labels
                warnings.simplefilter("ignore")
                study.set_metric_names(["relative_accuracy", "speedup"])
            study.set_user_attr("search", cfg.public_dump())
            for params, role in seeds:  # a proposed flow's defaults are where its study starts, not a baseline
                study.enqueue_trial(params, user_attrs={"role": "start" if foreign and role == "defaults" else role})
    else:
        try:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        except KeyError:
            raise SparsetuneError(f"study {name!r} is not in {masked_url(cfg.storage_url())}; start the search first") from None
    flows.studies[key], flows.classes[key], flows.args[key] = study, cls, flow
    if foreign:
        flows.foreign.add(key)
    return key


# ---- stale trials ---------------------------------------------------------------------------------

def ask(study: optuna.Study, retries_only: bool = False) -> optuna.Trial | None:
    """`study.ask()`, except that a retry (an interrupted or expired trial's params, enqueued again)
    is taken before the other enqueued points: Optuna pops enqueued trials oldest first, which
    would put the retry behind the seeds and, under `--trials`, possibly past the budget.
    `retries_only`: a retry or None."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if "retry_of" not in t.user_attrs:
            continue
        try:  # the state change is the lock, as in Optuna's own pop
            if study._storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                return optuna.Trial(study, t._trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None if retries_only else study.ask()


def retry(study: optuna.Study, trial: optuna.Trial | FrozenTrial, failure: str) -> None:
    """Tell the RUNNING `trial` FAIL with `failure` and enqueue its params again as its retry (which
    `ask` takes first). Raises RuntimeError or ValueError if another process finished it first."""
    for attr, value in (("failure", failure), ("retried", True)):
        study._storage.set_trial_user_attr(trial._trial_id, attr, value)
    study.tell(trial.number, state=TrialState.FAIL)
    study.enqueue_trial(trial.params, user_attrs={"role": trial.user_attrs.get("role", "search"), "retry_of": trial.number})


def expire_stale(flows: Studies, now: float | None = None, lease: float = LEASE_S) -> list[str]:
    """Tell FAIL every RUNNING trial whose heartbeat is older than `lease` (its worker is gone) and
    enqueue its params again; returns what was expired."""
    now = time.time() if now is None else now
    expired = []
    for key, study in flows.studies.items():
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            beat = t.user_attrs.get("heartbeat")
            if beat is None and t.datetime_start is not None:  # stopped before its first heartbeat
                beat = t.datetime_start.timestamp()  # naive local time, as Optuna 5 returns it
            if beat is None or now - beat <= lease:
                continue
            try:
                retry(study, t, f"expired: no heartbeat for {now - beat:.0f} s (its worker stopped)")
            except (RuntimeError, ValueError):  # another worker expired it first
                continue
            expired.append(f"{key}#{t.number}")
    return expired


class Heartbeat:
    """Writes the trial's heartbeat every `HEARTBEAT_S` while it runs (a background thread)."""

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial, self._stop = trial, threading.Event()
        trial.set_user_attr("heartbeat", time.time())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.trial.set_user_attr("heartbeat", time.time())
            except Exception:  # the trial was finished (or expired) meanwhile
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---- points ----------------------------------------------------------------------------------

def trial_records(flows: Studies) -> list[dict[str, Any]]:
    """Every finished trial's record, in start order."""
    out = []
    for key, study in flows.studies.items():
        confirmed = study.user_attrs
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            rec = dict(record_of(t) or {})
            rec.update(flow=key, number=t.number, state=t.state.name, role=t.user_attrs.get("role", "search"),
                       failure=t.user_attrs.get("failure"), confirm=confirmed.get(f"confirm:{t.number}"),
                       started=t.datetime_start.isoformat() if t.datetime_start else None,
                       finished=t.datetime_complete.isoformat() if t.datetime_complete else None)
            out.append(rec)
    return sorted(out, key=lambda r: (r["started"] or "", r["flow"], r["number"]))


def running_trials(flows: Studies, now: float | None = None) -> list[dict[str, Any]]:
    """The trials running now (or whose worker died within the lease): flow, number, params, worker,
    start, seconds since the last heartbeat."""
    now = time.time() if now is None else now
    out = []
    for key, study in flows.studies.items():
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            rec, beat = record_of(t) or {}, t.user_attrs.get("heartbeat")
            out.append({"flow": key, "number": t.number, "trial": f"{key}#{t.number}", "params": rec.get("params"),
                        "worker": t.user_attrs.get("worker"), "role": t.user_attrs.get("role", "search"),
                        "started": t.datetime_start.isoformat() if t.datetime_start else None,
                        "heartbeat_age_s": None if beat is None else round(now - beat, 1)})
    return sorted(out, key=lambda r: (r["started"] or "", r["flow"], r["number"]))


# ---- one trial ------------------------------------------------------------------------------------

def run_trial(cfg: SearchConfig, evaluator, flow: str, params: dict[str, str], out: Path) -> dict[str, Any]:
    """The cascade for one point; returns its record (stage: "speed", "quick" or "full")."""
    from sparsetune.tuning.trial import Hopeless

    t0 = time.perf_counter()
    rec: dict[str, Any] = {"params": params, "stage": "speed"}
    speed_after = cfg.kind == "reuse" and evaluator.speed_after_accuracy()  # a reuse flow's modeled speed
    if not speed_after:
        speedup, speed = evaluator.speedup(flow, params)
        rec["speed"] = {"speedup": speedup, **speed}
        if speedup <= 1.0:
            rec["reason"] = f"{speed['kind']} speedup {speedup:g} <= 1: {'dense' if cfg.kind == 'decode' else 'full recompute'} is as fast"
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            return rec
    bar = cfg.min_accuracy or 1.0
    floor = cfg.quick_floor * bar

    def on_chunk(partial: dict[str, Any]) -> None:
        rel = partial.get("relative_accuracy")
        if rel is not None and rel < floor:
            raise Hopeless(f"relative accuracy {rel:.3f} on the first {partial.get('samples_done')} samples < {floor:.3f}")

    acc = evaluator.accuracy(flow, params, samples=cfg.samples, seed=cfg.seed, out=out, on_chunk=on_chunk)
    rec["accuracy"] = acc.to_dict()
    if speed_after:
        speedup, speed = evaluator.speedup(flow, params, acc)
        rec["speed"] = {"speedup": speedup, **speed}
    if acc.complete:
        rec["stage"] = "full"
    else:
        rec["stage"] = "quick"
        rec["reason"] = f"relative accuracy {acc.relative} on the first {acc.samples} samples < {floor:.3f} (cascade)"
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def _tell(study: optuna.Study, trial: optuna.Trial, rec: dict[str, Any], cfg: SearchConfig) -> None:
    acc = (rec.get("accuracy") or {}).get("relative_accuracy")
    values = [0.0 if acc is None else float(acc), float(rec["speed"]["speedup"])]
    trial.set_constraint("cascade", 0.0 if rec["stage"] == "full" else 1.0)
    if cfg.min_accuracy is not None:
        trial.set_constraint("accuracy", cfg.min_accuracy - values[0])
    trial.set_user_attr("record", rec)
    study.tell(trial, values)


# ---- the loop -----------------------------------------------------------------------------------

class Budget:
    """`--trials` across every study and worker, and `--hours` for this process."""

    def __init__(self, cfg: SearchConfig, start: float) -> None:
        self.cfg, self.start = cfg, start
        self.deadline = None if cfg.hours is None else start + cfg.hours * 3600
        self.durations: list[float] = []  # this process's trials, in order

    @property
    def trial_s(self) -> float:
        """What the next trial may take: the slowest after the first (the first loads the engines
        and runs the dense pass), or half the first while it is the only one."""
        d = self.durations
        return max(d[1:]) if len(d) > 1 else (d[0] / 2 if d else 0.0)

    @property
    def typical_s(self) -> float:
        """A trial's median time after the first (half the first while it is the only one)."""
        d = sorted(self.durations[1:])
        return d[len(d) // 2] if d else self.trial_s

    def left_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    def others_running(self, flows: Studies, reserve_s: float = 0.0) -> list[str]:
        """Called when the budget says stop: under `--trials`, with time left, the trials other
        workers run now (this one runs none between trials). The worker waits for them before it
        leaves, so that one whose worker died expires and is run again here instead of being lost
        with the budget, which counts it."""
        left = self.left_s()
        if self.cfg.trials is None or (left is not None and left < self.trial_s + reserve_s):
            return []
        return [r["trial"] for r in running_trials(flows)]

    def reason_to_stop(self, flows: Studies, reserve_s: float = 0.0) -> str | None:
        if self.cfg.trials is not None and trial_count(flows.studies) >= self.cfg.trials:
            return f"{self.cfg.trials} trials done"
        left = self.left_s()
        if left is not None and left < self.trial_s + reserve_s:
            return f"--hours {self.cfg.hours:g} spent (no trial fits in the {max(0.0, left):.0f} s left)"
        if self.cfg.trials is None and self.cfg.hours is None:
            return "no --trials or --hours"
        return None


def pick_flow(flows: Studies, records: list[dict[str, Any]], turn: int, min_accuracy: float | None) -> str:
    """Which flow's study runs the next trial (module docstring: allocation)."""
    run = tuple(s for s in TrialState if s != TrialState.WAITING)
    counts = {k: len(s.get_trials(deepcopy=False, states=run)) for k, s in flows.studies.items()}  # run or running
    keys = list(flows.studies)
    waiting = {k: flows.studies[k].get_trials(deepcopy=False, states=(TrialState.WAITING,)) for k in keys}
    retries = [k for k in keys if any("retry_of" in t.user_attrs for t in waiting[k])]
    if retries:  # interrupted or expired trials first (under --trials the budget may hold only them)
        return min(retries, key=lambda k: (counts[k], keys.index(k)))
    enqueued = [k for k in keys if waiting[k]]
    if enqueued:  # then the other enqueued points (seeds), flows interleaved
        return min(enqueued, key=lambda k: (counts[k], keys.index(k)))
    cold = [k for k in keys if counts[k] < WARM_TRIALS]
    if cold or turn % 3 == 2:
        pool = cold or keys
        return min(pool, key=lambda k: (counts[k], keys.index(k)))
    points = [point_of(r) for r in records if eligible(r, min_accuracy)]
    total = hypervolume(points)

    def share(k: str) -> float:
        return total - hypervolume([p for p in points if not p.name.startswith(f"{k}#")])

    return max(keys, key=lambda k: (share(k), -counts[k], -keys.index(k)))


def work(cfg: SearchConfig, flows: Studies, evaluator, budget: Budget, *, on_event: EventFn | None = None,
         reserve_s: Callable[[], float] = lambda: 0.0, worker: str | None = None, run: Callable | None = None,
         between: Callable[[], None] | None = None) -> str:
    """Run trials until the budget is spent; returns why it stopped. Ctrl-C: the running trial is
    told FAIL and enqueued again, then KeyboardInterrupt propagates. `run`: what runs a trial
    (`run_trial`'s signature; a sandbox's for `--agent`); `between()`: called before each trial (a
    proposer adds its flows to `flows` there)."""
    emit = on_event or (lambda kind, data: None)
    worker = worker or f"{socket.gethostname()}:{os.getpid()}"
    run = run or run_trial
    turn, failures, waited_on = 0, [], []
    while True:
        for name in expire_stale(flows):
            emit("expired", {"trial": name})
        if between is not None:
            between()
        reserve = reserve_s()
        stop = budget.reason_to_stop(flows, reserve)
        running = budget.others_running(flows, reserve) if stop is not None else []
        if running:  # the last trials run elsewhere: a dead worker's expires (above) and runs here
            if running != waited_on:
                emit("waiting", {"trials": running, "lease_s": LEASE_S})
            waited_on = running
            time.sleep(WAIT_S)
            continue
        if stop is not None:
            return stop
        records = trial_records(flows)
        key = pick_flow(flows, records, turn, cfg.min_accuracy)
        study = flows.studies[key]
        # After a wait, the room in the budget is an expired trial's: take only its retry (another
        # waiting worker may have taken it, and a new point would run past --trials).
        trial = ask(study, retries_only=bool(waited_on))
        if trial is None:  # another worker took it: look again
            time.sleep(min(1.0, WAIT_S))
            continue
        turn, waited_on = turn + 1, []
        trial.set_user_attr("worker", worker)
        role = trial.user_attrs.get("role", "search")
        beat = Heartbeat(trial)
        t0 = time.time()
        params: dict[str, str] = {}
        try:
            params = suggest(trial, flows.classes[key], flows.num_layers, fixed_params(cfg, flows.classes[key]))
            trial.set_user_attr("record", {"params": params, "stage": "running", "worker": worker})  # an expired trial's
            emit("start", {"flow": key, "number": trial.number, "params": params, "role": role})
            rec = run(cfg, evaluator, flows.args[key], params, cfg.run_dir / "trials" / f"{key}-{trial.number}")
            rec["worker"] = worker
            beat.stop()
            _tell(study, trial, rec, cfg)
            emit("done", {"flow": key, "number": trial.number, "record": rec, "role": role})
        except KeyboardInterrupt:
            beat.stop()
            retry(study, trial, "interrupted (Ctrl-C); enqueued again")
            raise
        except IsolationRefused:  # the host, not the point: nothing ran, nothing will; the trial waits
            beat.stop()
            retry(study, trial, "the sandbox cannot isolate on this host; enqueued again")
            raise
        except Exception as e:  # noqa: BLE001 - a failed trial is recorded and the search goes on
            beat.stop()
            reason = f"{type(e).__name__}: {e}".strip().splitlines()[0][:500]
            trial.set_user_attr("failure", reason)
            trial.set_user_attr("record", {"params": params, "stage": "failed", "worker": worker})
            study.tell(trial, state=TrialState.FAIL)
            emit("failed", {"flow": key, "number": trial.number, "reason": reason, "params": params})
            if key not in flows.foreign:  # a proposed flow failing says nothing about the engine
                failures.append(reason)
            if len(failures) >= FAILURES_IN_A_ROW:  # the engine, not the point, is broken
                return f"{len(failures)} trials in a row failed (last: {reason})"
        else:
            failures = []
        budget.durations.append(time.time() - t0)
        emit("trial", {})


# ---- confirmation ---------------------------------------------------------------------------------

def confirm(cfg: SearchConfig, flows: Studies, evaluator, on_event: EventFn | None = None,
            deadline: float | None = None) -> None:
    """Re-evaluate each frontier point and each flow's defaults on fresh prompts (another seed,
    `confirm_samples` per task); the figures go into the study (`user_attrs["confirm:<trial>"]`).
    A point that does not hold leaves the frontier, which can expose points it dominated: those are
    confirmed in the next round, until every frontier point has held (or, after the first round,
    `deadline` has passed)."""
    emit = on_event or (lambda kind, data: None)
    rounds = 0
    while todo := to_confirm(trial_records(flows), cfg.min_accuracy):
        if rounds and deadline is not None and time.time() >= deadline:
            break
        rounds += 1
        for i, rec in enumerate(todo):
            emit("confirm", {"flow": rec["flow"], "number": rec["number"], "index": i, "total": len(todo), "round": rounds})
            acc = evaluator.accuracy(flows.args[rec["flow"]], rec["params"], samples=cfg.confirm_samples,
                                     seed=cfg.seed + CONFIRM_SEED_OFFSET, out=cfg.run_dir / "confirm")
            conf = confirmation(acc.to_dict(), rec["accuracy"], cfg.min_accuracy)
            flows.studies[rec["flow"]].set_user_attr(f"confirm:{rec['number']}", conf)  # a finished trial is read-only


def to_confirm(records: list[dict[str, Any]], min_accuracy: float | None) -> list[dict[str, Any]]:
    """The points not yet confirmed on the search-set frontier of the points that have not failed
    confirmation, and each flow's defaults."""
    failed = {trial_name(r) for r in records if r.get("confirm") is not None and not r["confirm"].get("holds")}
    front = {p.name for p in search_frontier([r for r in records if trial_name(r) not in failed], min_accuracy)}
    return [r for r in records if r.get("confirm") is None and r["state"] == "COMPLETE" and r.get("stage") == "full"
            and (trial_name(r) in front or r["role"] == "defaults")]


def confirmation(acc: dict[str, Any], search_acc: dict[str, Any], min_accuracy: float | None) -> dict[str, Any]:
    """Confirmed figures with a 95% interval (Wilson on the flow's accuracy over its samples, as a
    share of dense on the same prompts), and whether the search-set figure holds up."""
    rel, dense, n = acc.get("relative_accuracy"), acc.get("dense_accuracy"), acc.get("samples") or 0
    low = high = None
    if rel is not None and dense and n:
        lo, hi = wilson_interval(acc["accuracy"] * n, n)
        low, high = round(lo / dense, 4), round(hi / dense, 4)
    search_rel = search_acc.get("relative_accuracy")
    if rel is None:
        holds = False
    elif min_accuracy is not None:  # the bar, on fresh prompts
        holds = rel >= min_accuracy
    else:  # the search figure is not above what fresh prompts allow (a better figure holds)
        holds = high is not None and search_rel <= high + 1e-9
    return {**acc, "interval": [low, high], "holds": bool(holds)}


def confirm_reserve(cfg: SearchConfig, flows: Studies, budget: Budget) -> float:
    """Time kept back for confirmation, scaled to `confirm_samples`: the dense pass on the fresh
    prompts and each point still to confirm (`to_confirm`, a resumed study's confirmed points not
    among them) plus one the next trial may add, each about a typical trial. (Not the first trial:
    it also loaded the engines, about a minute on a GPU, which kept short `--hours` runs idle.)"""
    points = len(to_confirm(trial_records(flows), cfg.min_accuracy)) + 1
    return (1 + points) * budget.typical_s * cfg.confirm_samples / cfg.samples


# ---- entry points ---------------------------------------------------------------------------------

def _writer(cfg: SearchConfig, flows: Studies, on_event: EventFn | None) -> EventFn:
    """Events go to `on_event`; after every trial the run folder is rewritten."""
    from sparsetune.tuning.report import write_outputs

    def emit(kind: str, data: dict[str, Any]) -> None:
        if kind == "trial":
            data = {"summary": write_outputs(cfg, trial_records(flows))}
        if on_event is not None:
            on_event(kind, data)

    return emit


def spawn_workers(cfg: SearchConfig, workers: int) -> list[tuple[subprocess.Popen, Path]]:
    """`workers - 1` more processes on this host (`sparsetune search worker` on the search's storage,
    each with its own engine and run folder under `runs/<study>/workers/`, its log there): one GPU
    each on a GPU host (this process keeps the first); the CPU's cores split between them."""
    import sys

    from sparsetune.device import resolve_device

    if workers <= 1:
        return []
    import torch

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if resolve_device(cfg.device).type == "cuda":
        count = torch.cuda.device_count()
        if workers > count:
            raise SparsetuneError(f"--workers {workers}: {count} GPU(s) visible and a worker needs one each; "
                                  f"use --workers {count} (or workers on other hosts with --storage postgresql://...)")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(count)]
        devices = gpus[1:workers]
    else:
        devices = [None] * (workers - 1)
    # The cores split on a GPU host too: two workers at 32 threads each on a 32-core H100 host ran the
    # same points' evaluations ~10x slower than one worker did, their GPU steps unchanged (BENCHMARKS.md, #19)
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)  # this process's share
    folder = cfg.run_dir / "workers"
    folder.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, gpu in enumerate(devices, start=1):
        cmd = [sys.executable, "-c", "from sparsetune.cli.main import main; main()", "search", "worker",
               "--study", cfg.study, "--storage", cfg.storage_url(), "--out", str(folder / f"w{i}")]
        cmd += ["--threads", str(threads)]
        log = folder / f"w{i}.log"
        with open(log, "w") as f:
            procs.append((subprocess.Popen(cmd, env=env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu},
                                           stdout=f, stderr=subprocess.STDOUT), log))
    return procs


def finish_workers(procs: list[tuple[subprocess.Popen, Path]], emit: EventFn, timeout: float | None = None) -> None:
    """Wait for the spawned workers (they stop when the budget is spent); one still running after
    `timeout` is stopped as Ctrl-C stops a search (its trial is enqueued again)."""
    for proc, log in procs:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        emit("worker", {"pid": proc.pid, "returncode": rc, "log": str(log)})


def run_search(cfg: SearchConfig, evaluator=None, on_event: EventFn | None = None, workers: int = 1,
               agent=None) -> dict[str, Any]:
    """Run (or continue) the search `cfg.study`: trials until `--trials`/`--hours` (with `workers - 1`
    more processes on this host, `spawn_workers`), then confirmation; returns frontier.json's object.
    Ctrl-C leaves the study consistent and the files written. `on_event("begin", ...)` comes first,
    once the studies are open: the study, its run folder, the trials it already has (`done`: a
    resumed study's progress counts from there) and the command that resumes it (`resume`).

    `agent` (`--agent`; `sparsetune.agents.loop.Agent` is the one there is): `attach(flows, budget,
    emit)` once the studies are open, then its `evaluator` and `run_trial` run every trial and
    confirmation, `step()` runs before each trial (where it adds new flows), `close(result)` at the end."""
    from sparsetune.tuning.report import write_outputs
    from sparsetune.tuning.trial import EngineEvaluator

    flows = open_flows(cfg, create=True)
    write_json_config(cfg)
    budget = Budget(cfg, time.time())
    emit = _writer(cfg, flows, on_event)
    emit("begin", {"study": cfg.study, "run_dir": str(cfg.run_dir), "done": trial_count(flows.studies, running=False),
                   "resume": resume_command(cfg, workers)})
    if agent is not None:
        agent.attach(flows, budget, emit)
        evaluator = agent.evaluator
    procs = spawn_workers(cfg, workers)
    evaluator = evaluator or EngineEvaluator(cfg)
    stopped = "interrupted"
    try:
        stopped = work(cfg, flows, evaluator, budget, on_event=emit, reserve_s=lambda: confirm_reserve(cfg, flows, budget),
                       run=agent and agent.run_trial, between=agent and agent.step)
        finish_workers(procs, emit)
        procs = []
        confirm(cfg, flows, evaluator, on_event, deadline=budget.deadline)
    finally:
        finish_workers(procs, emit, timeout=0)  # interrupted: the workers stop too
        result = write_outputs(cfg, trial_records(flows), complete=stopped != "interrupted", stopped=stopped)
        if agent is not None:
            agent.close(result)
    if cfg.save_defaults:
        from sparsetune.records import write_json

        result["saved_defaults"] = save_defaults(cfg, result)
        write_json(cfg.run_dir / "frontier.json", result)
    return result


def save_defaults(cfg: SearchConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """`--save-defaults`: per flow, the fastest point of the confirmed frontier that kept
    `--min-accuracy` on fresh prompts becomes the model's tuned default for it (`flow.defaults`),
    with the study it came from; a flow without one keeps what it had, and says why."""
    from datetime import datetime, timezone

    from sparsetune.flow.params import is_flow_file
    from sparsetune.models.artifacts import save_tuned_defaults
    from sparsetune.models.resolve import model_config

    model = model_config(cfg.model, False)[0]
    out = []
    for flow in cfg.flows:
        key = flow_key(flow)
        if is_flow_file(flow):
            out.append({"flow": key, "saved": False, "reason": "a flow file keeps its own defaults (edit its Params)"})
            continue
        held = [r for r in result["confirmed_frontier"] if r["flow"] == key and r["holds"]
                and r["confirmed_accuracy"] >= cfg.min_accuracy]
        if not held:
            out.append({"flow": key, "saved": False, "reason": f"no confirmed point kept {cfg.min_accuracy:g} of dense"})
            continue
        best = max(held, key=lambda r: (r["speedup"], r["confirmed_accuracy"]))
        source = {"study": cfg.study, "storage": masked_url(cfg.storage_url()), "trial": best["trial"],
                  "relative_accuracy": best["relative_accuracy"], "confirmed_accuracy": best["confirmed_accuracy"],
                  "interval": best["interval"], "speedup": best["speedup"], "speed_kind": best["speed_kind"],
                  "context": cfg.context, "tasks": list(cfg.tasks or ()), "samples": cfg.samples,
                  "confirm_samples": cfg.confirm_samples, "saved": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        path = save_tuned_defaults(model, False, key, best["params"], source)
        out.append({"flow": key, "saved": True, "trial": best["trial"], "params": best["params"], "file": str(path)})
    return out


def run_worker(study: str, storage: str, out: str | None = None, evaluator=None,
               on_event: EventFn | None = None) -> dict[str, Any]:
    """Join the search `study` in `storage`: run its trials until its budget is spent (no confirmation:
    the coordinator does that). The search's config comes from the storage."""
    from sparsetune.tuning.report import write_outputs
    from sparsetune.tuning.trial import EngineEvaluator

    shown = masked_url(storage)
    stored = stored_config(open_storage(storage, create=False), study)
    if stored is None:
        raise SparsetuneError(f"no search {study!r} in {shown}; start it with sparsetune search --study {study} "
                              f"--storage {shown}")
    cfg = stored.model_copy(update={"storage": storage, **({"out": out} if out else {})})
    flows = open_flows(cfg, create=False)
    evaluator = evaluator or EngineEvaluator(cfg)
    budget = Budget(cfg, time.time())
    emit = _writer(cfg, flows, on_event)
    emit("begin", {"study": study, "run_dir": str(cfg.run_dir), "done": trial_count(flows.studies, running=False),
                   "resume": shlex.join(["sparsetune", "search", "worker", "--study", study, "--storage", shown]
                                        + (["--out", out] if out else []))})
    stopped = "interrupted"
    try:  # with the coordinator's reserve, so that its confirmation fits in --hours
        stopped = work(cfg, flows, evaluator, budget, on_event=emit, reserve_s=lambda: confirm_reserve(cfg, flows, budget))
    finally:
        result = write_outputs(cfg, trial_records(flows), complete=False, stopped=stopped)
    return result


def show(run_dir: str | Path | None = None, *, study: str | None = None, storage: str | None = None) -> dict[str, Any]:
    """frontier.json's object for a search, from its studies now (a run folder, or study + storage;
    `storage` with a run folder: its storage with the password search.json does not keep). Reads
    only: the run folder's files are the search's to write."""
    from sparsetune.tuning.report import summary

    if run_dir is not None:
        cfg = run_folder_config(Path(run_dir), storage)
    else:
        if study is None or storage is None:
            raise SparsetuneError("pass a run folder (runs/<study>), or --study and --storage")
        stored = stored_config(open_storage(storage, create=False), study)
        if stored is None:
            raise SparsetuneError(f"no search {study!r} in {masked_url(storage)}")
        cfg = stored.model_copy(update={"storage": storage})
    flows = open_flows(cfg, create=False)
    storage = next(iter(flows.studies.values()))._storage
    for name in optuna.get_all_study_names(storage):  # flows a proposer added (`--agent`): records only
        key = name.removeprefix(f"{cfg.study}/")
        if name.startswith(f"{cfg.study}/") and key not in flows.studies:
            flows.studies[key] = optuna.load_study(study_name=name, storage=storage)
    records = trial_records(flows)
    s = summary(cfg, records, complete=False, stopped=None)
    s["records"], s["running"] = records, running_trials(flows)
    return s


def run_folder_config(path: Path, storage: str | None = None) -> SearchConfig:
    """The config in a run folder's search.json (`storage`: in place of the one it names, which it
    keeps without its password); a file that is not one, or a storage it cannot name: one line."""
    conf = path / "search.json"
    if not conf.is_file():
        raise SparsetuneError(f"{path}: not a search folder (no search.json); pass runs/<study>")
    try:
        cfg = SearchConfig.model_validate(json.loads(conf.read_text())["search"])
    except (ValueError, KeyError, TypeError) as e:  # bad JSON, no "search", or not a config (pydantic's ValueError)
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SparsetuneError(f"{conf}: not a search's config ({type(e).__name__}: {what}); pass the folder a "
                              "sparsetune search wrote (runs/<study>)") from None
    if storage is None and cfg.storage is not None and MASK in cfg.storage:
        raise SparsetuneError(f"{conf} names the search's storage without its password ({cfg.storage}); pass it: "
                              f"sparsetune search show {path} --storage URL")
    # the journal in this folder by default (a folder copied or renamed keeps its own)
    return cfg.model_copy(update={"out": str(path.parent), "storage": storage or cfg.storage or str(path / "study.journal")})


def write_json_config(cfg: SearchConfig) -> None:
    from sparsetune.records import env_info, write_json

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    write_json(cfg.run_dir / "search.json", {"schema": "sparsetune.search.config/1", "search": cfg.public_dump(),
                                             "storage": masked_url(cfg.storage_url()), "env": env_info()})
