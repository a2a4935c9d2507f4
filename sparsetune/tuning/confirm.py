"""Confirmation: the frontier's points and each flow's defaults again, on fresh prompts.

The search set's figures are the best of many tries on the same prompts, so they flatter. The
coordinator re-evaluates each frontier point and each flow's defaults on prompts no trial saw
(another seed, `confirm_samples` per task); a point that does not hold leaves the frontier, which
can expose points it dominated, confirmed in the next round. The defaults are confirmed for the
report's "against the defaults" comparison; `--no-confirm-defaults` leaves them out (at a long
context each is minutes of the budget, and a point far below the bar adds nothing to the
frontier). `confirm_reserve` is the time the
budget keeps back for it; `save_defaults` (`--save-defaults`) makes each flow's fastest point
that held the model's tuned default.
"""

from __future__ import annotations

import time
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.sandbox import IsolationRefused
from sparsetune.tuning.config import SearchConfig, flow_key, masked_url
from sparsetune.tuning.frontier import search_frontier, trial_name, wilson_interval
from sparsetune.tuning.policy import FAILURES_IN_A_ROW, Budget, failure_reason
from sparsetune.tuning.protocols import EventFn, Evaluator
from sparsetune.tuning.studies import Studies, trial_records

CONFIRM_SEED_OFFSET = 1000


def confirm(cfg: SearchConfig, flows: Studies, evaluator: Evaluator, on_event: EventFn | None = None,
            deadline: float | None = None) -> None:
    """Re-evaluate each frontier point and each flow's defaults on fresh prompts (another seed,
    `confirm_samples` per task); the figures go into the study (`user_attrs["confirm:<trial>"]`).
    A point that does not hold leaves the frontier, which can expose points it dominated: those are
    confirmed in the next round, until every frontier point has held (or, after the first round,
    `deadline` has passed). A point whose evaluation fails (out of memory, say) does not hold in
    this run: its reason is recorded (`error`), the others are confirmed, and a resumed search
    tries it again; `FAILURES_IN_A_ROW` failures one after another stop the confirmation (a
    `SparsetuneError`: something other than the points is wrong)."""
    emit = on_event or (lambda kind, data: None)
    for rec in trial_records(flows):  # a resumed search tries again what an earlier run failed to evaluate
        if (rec.get("confirm") or {}).get("error"):
            flows.studies[rec["flow"]].set_user_attr(f"confirm:{rec['number']}", None)
    rounds, failures = 0, 0
    while todo := to_confirm(trial_records(flows), cfg.min_accuracy, cfg.confirm_defaults):
        if rounds and deadline is not None and time.time() >= deadline:
            break
        rounds += 1
        for i, rec in enumerate(todo):
            emit("confirm", {"flow": rec["flow"], "number": rec["number"], "index": i, "total": len(todo), "round": rounds})
            try:
                acc = evaluator.accuracy(flows.args[rec["flow"]], rec["params"], samples=cfg.confirm_samples,
                                         seed=cfg.seed + CONFIRM_SEED_OFFSET, out=cfg.run_dir / "confirm")
            except IsolationRefused:  # the host, not the point
                raise
            except Exception as e:  # noqa: BLE001 - as a trial's failure: recorded with its reason, and the search goes on
                reason = failure_reason(e)
                emit("confirm_failed", {"flow": rec["flow"], "number": rec["number"], "reason": reason})
                flows.studies[rec["flow"]].set_user_attr(f"confirm:{rec['number']}", {"holds": False, "error": reason})
                failures += 1
                if failures >= FAILURES_IN_A_ROW:  # the engine, not the points: stop, keep the study
                    raise SparsetuneError(f"{failures} confirmations in a row failed (last: {reason}); the study is "
                                          "kept: fix the cause and rerun with --resume to confirm again") from None
                continue
            failures = 0
            conf = confirmation(acc.to_dict(), rec["accuracy"], cfg.min_accuracy)
            flows.studies[rec["flow"]].set_user_attr(f"confirm:{rec['number']}", conf)  # a finished trial is read-only


def to_confirm(records: list[dict[str, Any]], min_accuracy: float | None, defaults: bool = True) -> list[dict[str, Any]]:
    """The points not yet confirmed on the search-set frontier of the points that have not failed
    confirmation, and (`defaults`) each flow's defaults."""
    failed = {trial_name(r) for r in records if r.get("confirm") is not None and not r["confirm"].get("holds")}
    front = {p.name for p in search_frontier([r for r in records if trial_name(r) not in failed], min_accuracy)}
    return [r for r in records if r.get("confirm") is None and r["state"] == "COMPLETE" and r.get("stage") == "full"
            and (trial_name(r) in front or (defaults and r["role"] == "defaults"))]


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
    points = len(to_confirm(trial_records(flows), cfg.min_accuracy, cfg.confirm_defaults)) + 1
    return (1 + points) * budget.typical_s * cfg.confirm_samples / cfg.samples


def save_defaults(cfg: SearchConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """`--save-defaults`: per flow, the fastest point of the confirmed frontier that kept
    `--min-accuracy` on fresh prompts becomes the model's tuned default for it (`setup.tuned_defaults`),
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
