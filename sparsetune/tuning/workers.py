"""Several workers on one search: leases on the trials in flight, and the worker processes.

A worker (the `search` command itself, or `search worker` joining it, on this host or another)
asks a study for a trial, runs it and tells the result; the storage is all the workers share.
A trial in flight holds a lease its `Heartbeat` renews every `HEARTBEAT_S`. A RUNNING trial whose
heartbeat is older than the lease (a killed worker) is told FAIL and its params enqueued again,
once, by whichever worker sees it first (`expire_stale`: the tell is the lock). Such a retry (or
an interrupted trial's, `retry`) is the next trial its flow runs, ahead of enqueued seeds (`ask`):
under `--trials` it is not left waiting when the budget is spent. `spawn_workers` starts more
workers on this host, one GPU each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.protocols import EventFn
from sparsetune.tuning.storage import record_of
from sparsetune.tuning.studies import Studies

HEARTBEAT_S = float(os.environ.get("SPARSETUNE_HEARTBEAT_S", "20"))
LEASE_S = 6 * HEARTBEAT_S
WAIT_S = min(5.0, HEARTBEAT_S / 4)  # how often a worker with nothing left to start looks at the others' trials


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
