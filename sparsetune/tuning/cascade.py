"""The cascade: one trial's stages, cheapest first, each able to stop it.

Multi-objective studies cannot prune, so a trial stops itself: (1) speed first, from the cost
model or the GPU: a point not faster than dense (speedup <= 1) cannot be on the frontier and
stops there (a reuse flow's modeled speed is what its evaluation computed, so it comes after (2)
and (3)); (2) accuracy on the first chunk of samples: below `quick_floor` x the bar
(min-accuracy, or dense) it stops; (3) the rest of the samples. Stage (2) decides from the figures
the evaluation hands over after each chunk, in process (the evaluator's `on_chunk`): below the
floor it raises `Hopeless` and the evaluator returns the figures so far. Stopped trials are told
with the figures they have and a violated "cascade" constraint (`tell`), so the sampler learns
from them and the frontier never holds them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna

from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.protocols import Hopeless, TrialEvaluator


def run_trial(cfg: SearchConfig, evaluator: TrialEvaluator, flow: str, params: dict[str, str],
              out: Path) -> dict[str, Any]:
    """The cascade for one point; returns its record (stage: "speed", "quick" or "full")."""
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

    def on_chunk(partial: dict[str, Any]) -> None:  # the figures so far, from the evaluation in process
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


def tell(study: optuna.Study, trial: optuna.Trial, rec: dict[str, Any], cfg: SearchConfig) -> None:
    """Tell `trial` its record's figures (relative accuracy, speedup), with the "cascade" constraint
    violated unless it ran in full and, with `--min-accuracy`, the accuracy constraint."""
    acc = (rec.get("accuracy") or {}).get("relative_accuracy")
    values = [0.0 if acc is None else float(acc), float(rec["speed"]["speedup"])]
    trial.set_constraint("cascade", 0.0 if rec["stage"] == "full" else 1.0)
    if cfg.min_accuracy is not None:
        trial.set_constraint("accuracy", cfg.min_accuracy - values[0])
    trial.set_user_attr("record", rec)
    study.tell(trial, values)
