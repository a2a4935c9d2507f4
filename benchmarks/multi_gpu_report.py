"""Issue #19, search across GPUs: what the studies in one storage show (`benchmarks/multi_gpu.sh report`).

    python benchmarks/multi_gpu_report.py --storage postgresql://... --studies one,two,kill --runs /tmp/runs

Per study: finished and failed trials, the workers that ran them, trials per hour (each worker's
trials after its first, which loads the engines, over the span of their finish times; summed over
workers), the wall time from the first trial's start to the last one's finish (engine loads
included) and how far each trial got (`stages`: a trial the cascade stops after its speed or
quick stage takes seconds, a full one 10-20 s, so two studies' rates compare like with like only
where the mixes agree), points run twice (the same flow and params finished more than once, other than the retry
of an expired trial), and whether the frontier the study holds equals the one its search wrote to
`runs/<study>/frontier.json`. Then the scaling of the second study over the first.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

from sparsetune.tuning.report import summary
from sparsetune.tuning.storage import open_storage, stored_config
from sparsetune.tuning.studies import open_flows, trial_records


def trials_per_hour(done: list[dict]) -> float | None:
    by_worker = defaultdict(list)
    for r in done:
        by_worker[r.get("worker")].append(datetime.fromisoformat(r["finished"]).timestamp())
    rate = 0.0
    for ends in by_worker.values():
        ends.sort()
        if len(ends) > 2 and ends[-1] > ends[0]:
            rate += (len(ends) - 1) / (ends[-1] - ends[0]) * 3600
    return round(rate, 1) if rate else None


def wall_seconds(records: list[dict]) -> float | None:
    starts = [datetime.fromisoformat(r["started"]).timestamp() for r in records if r.get("started")]
    ends = [datetime.fromisoformat(r["finished"]).timestamp() for r in records if r.get("finished")]
    return round(max(ends) - min(starts), 1) if starts and ends else None


def study_report(storage: str, study: str, runs: Path) -> dict:
    cfg = stored_config(open_storage(storage), study)
    if cfg is None:
        return {"study": study, "error": "no such search in the storage"}
    cfg = cfg.model_copy(update={"storage": storage})
    records = trial_records(open_flows(cfg, create=False))
    done = [r for r in records if r["state"] == "COMPLETE"]  # seeded points (role "defaults") included
    failed = [r for r in records if r["state"] == "FAIL"]
    expired = Counter(json.dumps([r["flow"], r.get("params")], sort_keys=True) for r in failed
                      if (r.get("failure") or "").startswith("expired"))
    runs_of = Counter(json.dumps([r["flow"], r["params"]], sort_keys=True) for r in done)
    twice = {k: n for k, n in runs_of.items() if n > 1 + expired.get(k, 0)}
    held = [r["trial"] for r in summary(cfg, records, complete=False, stopped=None)["frontier"]]
    written = runs / study / "frontier.json"
    wrote = [r["trial"] for r in json.loads(written.read_text())["frontier"]] if written.is_file() else None
    return {"study": study, "finished": len(done), "failed": len(failed),
            "failures": [{"flow": r["flow"], "params": r.get("params"), "failure": r["failure"]} for r in failed],
            "redone": {k: runs_of.get(k, 0) for k in expired},
            "workers": dict(Counter(str(r.get("worker")) for r in done)), "trials_per_hour": trials_per_hour(done),
            "wall_s": wall_seconds(records), "stages": dict(Counter(str(r.get("stage")) for r in done)),
            "run_twice": twice, "frontier_held": held, "frontier_written": wrote,
            "frontier_equal": wrote is not None and held == wrote}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage", required=True)
    ap.add_argument("--studies", required=True, help="comma-separated: the one-GPU study first, then the others")
    ap.add_argument("--runs", default="runs", type=Path, help="the searches' --out folder")
    args = ap.parse_args()
    reports = [study_report(args.storage, s, args.runs) for s in args.studies.split(",")]
    out = {"studies": reports}
    rates = [r.get("trials_per_hour") for r in reports[:2]]
    if len(rates) == 2 and all(rates):
        out["scaling"] = round(rates[1] / rates[0], 3)
    walls = [(r.get("finished"), r.get("wall_s")) for r in reports[:2]]
    if len(walls) == 2 and all(n and w for n, w in walls):  # finished trials per wall-clock hour, engine loads included
        out["scaling_wall"] = round((walls[1][0] / walls[1][1]) / (walls[0][0] / walls[0][1]), 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
