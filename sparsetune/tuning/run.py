"""The search: trials of every flow's study on one engine, a merged frontier, confirmation.

A worker (`run_search`, the `search` command itself, or `run_worker`, `search worker` joining
it) repeats `work`: expire stale trials (`workers`), pick a flow and check the budget
(`policy`), `ask` its study, run the trial's cascade (`cascade`), `tell` the result, rewrite the
run folder's files (`report`). The coordinator then confirms the frontier on fresh prompts
(`confirm`). `show` reads a search back from its studies.

**Failure and resume.** A trial that raises is told FAIL with its reason (five in a row stop the
search: the engine, not the point, is broken). Ctrl-C stops the running trial, tells it FAIL
("interrupted") and enqueues its params again, so a resumed study redoes it; a killed worker's
trial expires and is redone the same way (`workers`).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.sandbox import IsolationRefused
from sparsetune.tuning.cascade import run_trial, tell
from sparsetune.tuning.config import MASK, SearchConfig, masked_url, resume_command
from sparsetune.tuning.confirm import confirm, confirm_reserve, save_defaults
from sparsetune.tuning.policy import FAILURES_IN_A_ROW, Budget, failure_reason, pick_flow
from sparsetune.tuning.protocols import AgentHooks, EventFn, Evaluator, TrialEvaluator, TrialFn
from sparsetune.tuning.space import suggest
from sparsetune.tuning.storage import open_storage, stored_config, trial_count
from sparsetune.tuning.studies import Studies, fixed_params, open_flows, trial_records
from sparsetune.tuning.workers import (LEASE_S, WAIT_S, Heartbeat, ask, expire_stale, finish_workers, retry,
                                       running_trials, spawn_workers)


def work(cfg: SearchConfig, flows: Studies, evaluator: Evaluator, budget: Budget, *, on_event: EventFn | None = None,
         reserve_s: Callable[[], float] = lambda: 0.0, worker: str | None = None, run: TrialFn | None = None,
         between: Callable[[], None] | None = None) -> str:
    """Run trials until the budget is spent; returns why it stopped. Ctrl-C: the running trial is
    told FAIL and enqueued again, then KeyboardInterrupt propagates. `run`: what runs a trial
    (`cascade.run_trial`, which needs a `TrialEvaluator`; a sandbox's for `--agent`); `between()`:
    called before each trial (a proposer adds its flows to `flows` there)."""
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
            params = suggest(trial, flows.classes[key], flows.num_layers, fixed_params(cfg, key, flows.classes[key]))
            trial.set_user_attr("record", {"params": params, "stage": "running", "worker": worker})  # an expired trial's
            emit("start", {"flow": key, "number": trial.number, "params": params, "role": role})
            rec = run(cfg, evaluator, flows.args[key], params, cfg.run_dir / "trials" / f"{key}-{trial.number}")
            rec["worker"] = worker
            beat.stop()
            tell(study, trial, rec, cfg)
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
            reason = failure_reason(e)
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


def _writer(cfg: SearchConfig, flows: Studies, on_event: EventFn | None) -> EventFn:
    """Events go to `on_event`; after every trial the run folder is rewritten."""
    from sparsetune.tuning.report import write_outputs

    def emit(kind: str, data: dict[str, Any]) -> None:
        if kind == "trial":
            data = {"summary": write_outputs(cfg, trial_records(flows))}
        if on_event is not None:
            on_event(kind, data)

    return emit


def run_search(cfg: SearchConfig, evaluator: TrialEvaluator | None = None, on_event: EventFn | None = None,
               workers: int = 1, agent: AgentHooks | None = None) -> dict[str, Any]:
    """Run (or continue) the search `cfg.study`: trials until `--trials`/`--hours` (with `workers - 1`
    more processes on this host, `spawn_workers`), then confirmation; returns frontier.json's object.
    Ctrl-C leaves the study consistent and the files written. `on_event("begin", ...)` comes first,
    once the studies are open: the study, its run folder, the trials it already has (`done`: a
    resumed study's progress counts from there) and the command that resumes it (`resume`).

    `agent` (`--agent`; `sparsetune.agents.loop.Agent` is the one there is; `protocols.AgentHooks`):
    `attach(flows, budget, emit)` once the studies are open, then its `evaluator` and `run_trial` run
    every trial and confirmation, `step()` runs before each trial (where it adds new flows),
    `close(result)` at the end."""
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
    procs = spawn_workers(cfg, workers)
    used: Evaluator = agent.evaluator if agent is not None else evaluator or EngineEvaluator(cfg, on_event=emit)
    stopped = "interrupted"
    try:
        stopped = work(cfg, flows, used, budget, on_event=emit, reserve_s=lambda: confirm_reserve(cfg, flows, budget),
                       run=agent and agent.run_trial, between=agent and agent.step)
        finish_workers(procs, emit)
        procs = []
        try:
            confirm(cfg, flows, used, on_event, deadline=budget.deadline)
        except BaseException as e:  # the files say the confirmation did not finish
            stopped = "interrupted" if isinstance(e, KeyboardInterrupt) else "confirmation failed"
            raise
    finally:
        finish_workers(procs, emit, timeout=0)  # interrupted: the workers stop too
        result = write_outputs(cfg, trial_records(flows), complete=stopped not in ("interrupted", "confirmation failed"),
                               stopped=stopped)
        if agent is not None:
            agent.close(result)
    if cfg.save_defaults:
        from sparsetune.records import write_json

        result["saved_defaults"] = save_defaults(cfg, result)
        write_json(cfg.run_dir / "frontier.json", result)
    return result


def run_worker(study: str, storage: str, out: str | None = None, evaluator: TrialEvaluator | None = None,
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
    budget = Budget(cfg, time.time())
    emit = _writer(cfg, flows, on_event)
    evaluator = evaluator or EngineEvaluator(cfg, on_event=emit)
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
    """The run folder's search.json: the config (storage without its password), the environment."""
    from sparsetune.records import env_info, write_json

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    write_json(cfg.run_dir / "search.json", {"schema": "sparsetune.search.config/1", "search": cfg.public_dump(),
                                             "storage": masked_url(cfg.storage_url()), "env": env_info()})
