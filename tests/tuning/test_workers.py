"""Workers on one study in a real PostgreSQL server (started from the `pgserver` package): two
worker processes finish the budget with every trial run once and one merged frontier; a worker
killed mid-trial loses nothing (its trial expires and the other worker redoes it); SIGINT to a
search process leaves a study that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.report import summary
from sparsetune.tuning.run import write_json_config
from sparsetune.tuning.studies import open_flows, trial_records
from sparsetune.tuning.storage import trial_count

from helpers import sigint_default

pgserver = pytest.importorskip("pgserver")
TESTS = Path(__file__).resolve().parents[1]

WORKER = """
import json, sys
from helpers import SyntheticEvaluator
from sparsetune.tuning.run import run_worker
from sparsetune.tuning.storage import open_storage, stored_config
study, storage, out, sleep, log = sys.argv[1:6]
cfg = stored_config(open_storage(storage), study)
class Logged(SyntheticEvaluator):
    def accuracy(self, flow, params, **kw):
        with open(log, "a") as f:
            f.write(json.dumps([flow, params]) + "\\n")
        return SyntheticEvaluator.accuracy(self, flow, params, **kw)
run_worker(study, storage, out, Logged(cfg, sleep=float(sleep)))
"""

SEARCH = """
import sys
from helpers import SyntheticEvaluator
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.run import run_search
cfg = SearchConfig.model_validate_json(sys.argv[1])
run_search(cfg, SyntheticEvaluator(cfg, sleep=float(sys.argv[2])))
"""


@pytest.fixture(scope="module")
def postgres(tmp_path_factory):
    srv = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    yield srv
    srv.cleanup()


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), **extra}


def _database(postgres, name: str) -> str:
    postgres.psql(f"CREATE DATABASE {name};")
    return postgres.get_uri(name)


def _start(cfg: SearchConfig):
    open_flows(cfg, create=True)  # the coordinator creates the studies (and seeds the defaults) first
    write_json_config(cfg)


def _worker(cfg: SearchConfig, out: Path, sleep: float, log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, cfg.study, cfg.storage, str(out), str(sleep), str(log)],
                            env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _evaluated(*logs: Path) -> list:
    return [json.loads(line) for log in logs if log.exists() for line in log.read_text().splitlines()]


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_two_workers_on_postgres_run_every_trial_once_with_one_frontier(postgres, tmp_path):
    cfg = SearchConfig(study="pg2", storage=_database(postgres, "two"), out=str(tmp_path), trials=12, context=2048,
                       min_accuracy=0.9)
    _start(cfg)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_worker(cfg, tmp_path / f"w{i}", 0.3, logs[i]) for i in range(2)]
    for p in procs:
        _out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    flows = open_flows(cfg, create=False)
    records = trial_records(flows)
    done = [r for r in records if r["state"] == "COMPLETE"]
    evaluated = _evaluated(*logs)
    assert len({r["worker"] for r in done}) == 2  # both workers ran trials
    assert len(done) == len(evaluated) and 12 <= trial_count(flows.studies) <= 13  # at most one over: both asked at once
    # every trial was evaluated by one worker, once
    assert sorted(json.dumps([r["flow"], r["params"]], sort_keys=True) for r in done) == \
        sorted(json.dumps(e, sort_keys=True) for e in evaluated)
    assert not any(t.state == TrialState.RUNNING for s in flows.studies.values() for t in s.get_trials())
    # The folder written last holds the frontier the study holds
    merged = summary(cfg, records, complete=False, stopped=None)["frontier"]
    last = max((tmp_path / f"w{i}" / "pg2" / "frontier.json" for i in range(2)), key=lambda p: p.stat().st_mtime_ns)
    assert merged and [r["trial"] for r in json.loads(last.read_text())["frontier"]] == [r["trial"] for r in merged]


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_a_killed_worker_loses_nothing(postgres, tmp_path):
    # 4 trials, fewer than the 10 seeded points: the killed trial's retry runs ahead of them, within the budget
    cfg = SearchConfig(study="pgk", storage=_database(postgres, "kill"), out=str(tmp_path), trials=4, context=2048)
    _start(cfg)
    beat = {"SPARSETUNE_HEARTBEAT_S": "0.5"}  # lease: 3 s
    doomed = _worker(cfg, tmp_path / "a", 30.0, tmp_path / "a.log", **beat)
    deadline = time.time() + 60
    while not _evaluated(tmp_path / "a.log") and time.time() < deadline:
        time.sleep(0.2)
    assert _evaluated(tmp_path / "a.log"), "the first worker never started a trial"
    doomed.send_signal(signal.SIGKILL)  # mid-trial: no chance to tell anything
    doomed.wait()
    survivor = _worker(cfg, tmp_path / "b", 0.2, tmp_path / "b.log", **beat)
    _out, err = survivor.communicate(timeout=240)
    assert survivor.returncode == 0, err[-2000:]
    records = trial_records(open_flows(cfg, create=False))
    killed = [r for r in records if r["state"] == "FAIL"]
    assert len(killed) == 1 and killed[0]["failure"].startswith("expired")
    lost = _evaluated(tmp_path / "a.log")[0]
    assert [killed[0]["flow"], killed[0]["params"]] == lost  # its record names the point
    redone = [r for r in records if r["state"] == "COMPLETE" and [r["flow"], r["params"]] == lost]
    assert len(redone) == 1  # the killed trial's point, finished by the other worker
    assert sum(r["state"] == "COMPLETE" for r in records) == 4


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_sigint_to_a_search_process_leaves_a_study_that_resumes(tmp_path):
    cfg = SearchConfig(study="sig", out=str(tmp_path), trials=6, context=2048)
    proc = subprocess.Popen([sys.executable, "-c", SEARCH, cfg.model_dump_json(), "1.0"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    journal = tmp_path / "sig" / "trials.jsonl"
    deadline = time.time() + 90
    while (not journal.exists() or len(journal.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    flows = open_flows(cfg, create=False)
    states = [t.state for s in flows.studies.values() for t in s.get_trials()]
    assert TrialState.RUNNING not in states
    before = [r for r in trial_records(flows) if r["state"] == "COMPLETE"]
    assert json.loads((tmp_path / "sig" / "frontier.json").read_text())["complete"] is False
    proc = subprocess.run([sys.executable, "-c", SEARCH, cfg.model_dump_json(), "0.0"], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = [r for r in trial_records(open_flows(cfg, create=False)) if r["state"] == "COMPLETE"]
    assert len(after) == 6 and {(r["flow"], r["number"]) for r in before} <= {(r["flow"], r["number"]) for r in after}
    assert json.loads((tmp_path / "sig" / "frontier.json").read_text())["complete"] is True
