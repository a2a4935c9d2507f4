"""The Pareto frontier of a search: points that no other point beats in both accuracy and speed.

One search keeps a study per flow, so the frontier is merged here from every study's points, not
taken from one study. Accuracy comes from a few dozen samples, so each point carries a Wilson
score interval; hypervolume (the area the frontier dominates above a reference point) measures a
search's progress over time.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from sparsetune.errors import SparsetuneError


@dataclass(frozen=True)
class Point:
    """One evaluated configuration: both objectives are maximized."""

    name: str  # e.g. "quest#12" (flow and trial number)
    accuracy: float  # relative to dense on the same prompts (1.0: dense)
    speedup: float  # decode speedup over dense (measured, or modeled: `perf.cost.modeled_speedup`)
    params: dict[str, Any] = field(default_factory=dict, compare=False)


def dominates(a: Point, b: Point) -> bool:
    """`a` is at least as good as `b` in both objectives and better in one."""
    return a.accuracy >= b.accuracy and a.speedup >= b.speedup and (a.accuracy > b.accuracy or a.speedup > b.speedup)


def pareto(points: Iterable[Point]) -> list[Point]:
    """The non-dominated points, by increasing speedup (equal points: the first one given)."""
    front: list[Point] = []
    best_acc = -math.inf
    # Sort by speed descending, then accuracy descending: a point is on the front iff its accuracy
    # beats every point at least as fast.
    ordered = sorted(enumerate(points), key=lambda ip: (-ip[1].speedup, -ip[1].accuracy, ip[0]))
    for _, p in ordered:
        if p.accuracy > best_acc:
            front.append(p)
            best_acc = p.accuracy
    return front[::-1]


def hypervolume(points: Sequence[Point], ref_accuracy: float = 0.0, ref_speedup: float = 1.0) -> float:
    """Area dominated by `points` and bounded below by the reference (default: zero accuracy, dense
    speed); points not better than the reference in both objectives add nothing."""
    area, acc_covered = 0.0, ref_accuracy
    for p in reversed(pareto(q for q in points if q.accuracy > ref_accuracy and q.speedup > ref_speedup)):
        area += (p.speedup - ref_speedup) * (p.accuracy - acc_covered)  # fastest first: a staircase
        acc_covered = p.accuracy
    return area


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default): sound at 0 and n successes, where
    the normal approximation collapses to a point."""
    if n <= 0:
        raise ValueError("a proportion needs n >= 1")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


# ---- trial records (a search's `trials.jsonl` lines) ----------------------------------------------

def eligible(rec: dict[str, Any], min_accuracy: float | None) -> bool:
    """A finished trial that passed every stage and the accuracy constraint."""
    acc = rec.get("accuracy") or {}
    return (rec["state"] == "COMPLETE" and rec.get("stage") == "full" and acc.get("relative_accuracy") is not None
            and (min_accuracy is None or acc["relative_accuracy"] >= min_accuracy))


def trial_name(rec: dict[str, Any]) -> str:
    """A trial's name across the search's studies: its flow and number ("quest#12")."""
    return f"{rec['flow']}#{rec['number']}"


def point_of(rec: dict[str, Any], confirmed: bool = False) -> Point:
    acc = rec["confirm"]["relative_accuracy"] if confirmed else rec["accuracy"]["relative_accuracy"]
    return Point(trial_name(rec), acc, rec["speed"]["speedup"], rec.get("params", {}))


def search_frontier(records: list[dict[str, Any]], min_accuracy: float | None) -> list[Point]:
    return pareto(point_of(r) for r in records if eligible(r, min_accuracy))


def confirmed_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trials re-evaluated on fresh prompts (frontier points of each confirmation round, the defaults)."""
    return [r for r in records if (r.get("confirm") or {}).get("relative_accuracy") is not None]


def confirmed_frontier(records: list[dict[str, Any]]) -> list[Point]:
    """The frontier of the confirmed points that held, by their confirmed figures."""
    return pareto(point_of(r, confirmed=True) for r in confirmed_records(records) if r["confirm"]["holds"])


# ---- choosing a point of a search --------------------------------------------------------------

_PICK = re.compile(r"^\s*(max|min)\s+(speedup|accuracy|share)\s*(?:where\s+(.+?))?\s*$")
_COND = re.compile(r"^\s*(speedup|accuracy|share)\s*(>=|<=|>|<)\s*([0-9.]+)\s*$")
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
PICK_HELP = ('write "max|min speedup|accuracy|share [where accuracy|speedup|share >=|<=|>|< NUMBER [and ...]]", '
             'e.g. "max speedup where accuracy >= 0.95"')


def _value(row: dict[str, Any], what: str) -> float:
    """A confirmed point's figure: accuracy is the confirmed one (fresh prompts), relative to dense."""
    return {"speedup": row["speedup"], "accuracy": row["confirmed_accuracy"], "share": row.get("share")}[what]


def pick_point(rows: list[dict[str, Any]], rule: str) -> dict[str, Any]:
    """The confirmed point a `--pick` rule chooses, e.g. "max speedup where accuracy >= 0.95"."""
    m = _PICK.match(rule)
    if not m:
        raise SparsetuneError(f"--pick {rule!r}: {PICK_HELP}")
    how, what, where = m.groups()
    conds = []
    for part in re.split(r"\s+and\s+", where) if where else []:
        c = _COND.match(part)
        if not c:
            raise SparsetuneError(f"--pick {rule!r}: cannot read {part.strip()!r}; {PICK_HELP}")
        conds.append((c.group(1), _OPS[c.group(2)], float(c.group(3))))
    ok = [r for r in rows if all(_value(r, k) is not None and op(_value(r, k), x) for k, op, x in conds)]
    if not ok:
        raise SparsetuneError(f"--pick {rule!r}: no confirmed point meets it (confirmed: "
                              f"{', '.join(r['trial'] for r in rows) or 'none'}); loosen it or pass --trial")
    return (max if how == "max" else min)(ok, key=lambda r: _value(r, what))


def default_pick(bar: float | None) -> str:
    """The rule `--pick` takes by default: the fastest confirmed point at the search's bar."""
    return "max speedup" + (f" where accuracy >= {bar}" if bar is not None else "")
