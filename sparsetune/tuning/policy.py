"""Which flow runs the next trial, and whether one more fits: the allocation and the budget.

**Allocation between flows** (`pick_flow`). Each flow's study starts with its seeds (the
defaults, then each categorical's other levels at the defaults), the flows interleaved, and gets
trials round-robin until every flow has `WARM_TRIALS`; after that each trial goes to the flow
with the largest share of the merged frontier's hypervolume (the area only its points cover),
ties to the flow with fewer trials, and every third trial still round-robin. A flow whose points
are all dominated stops drawing trials except the round-robin ones, so no flow is written off on
a few noisy early trials. A retry (an interrupted or expired trial's params) comes first.

**The budget** (`Budget`): `--trials` across every study and worker (running trials count), and
`--hours` for this process: no trial starts that cannot finish before it runs out (the slowest
trial so far, after the first, which pays for loading engines and the dense pass, is the
estimate; time to confirm the frontier and the defaults is kept back, `confirm.confirm_reserve`).
A worker that finds `--trials` spent while other workers' trials still run waits for them before
it leaves: the budget counts running trials, so a worker that died in the last one would
otherwise take its point with it.
"""

from __future__ import annotations

import time
from typing import Any

from optuna.trial import TrialState

from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.frontier import eligible, hypervolume, point_of
from sparsetune.tuning.storage import trial_count
from sparsetune.tuning.studies import Studies
from sparsetune.tuning.workers import running_trials

WARM_TRIALS = 4
FAILURES_IN_A_ROW = 5  # trials (or confirmations) failing one after another: something other than the points is wrong


def failure_reason(e: BaseException) -> str:
    """What a failed trial or confirmation records: the exception's type and its first line."""
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:500]


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
            what = "the frontier and the defaults" if self.cfg.confirm_defaults else "the frontier"
            kept = f": confirming {what} needs about {reserve_s:.0f} s" if reserve_s >= 1 else ""
            return f"--hours {self.cfg.hours:g} spent (no trial fits in the {max(0.0, left):.0f} s left{kept})"
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
