"""The merged Pareto frontier against a brute-force reference, hypervolume on staircases computed
by hand, the Wilson interval against published values, and the comparison with the defaults."""

from __future__ import annotations

import random

import pytest

from sparsetune.tuning.frontier import Point, dominates, hypervolume, pareto, wilson_interval
from sparsetune.tuning.report import against_defaults, against_defaults_lines, plot_groups


def _brute_front(points: list[Point]) -> set[str]:
    keep = set()
    for i, p in enumerate(points):
        if any(dominates(q, p) for q in points):
            continue
        if any(q.accuracy == p.accuracy and q.speedup == p.speedup for q in points[:i]):
            continue  # an equal point given earlier stands for both
        keep.add(p.name)
    return keep


@pytest.mark.parametrize("seed", range(20))
def test_pareto_equals_brute_force(seed):
    rng = random.Random(seed)
    grid = [0.5, 0.75, 0.9, 1.0]  # ties in each objective on purpose
    points = [Point(f"p{i}", rng.choice(grid), rng.choice([1.0, 1.5, 2.0, 3.0])) for i in range(rng.randint(1, 25))]
    front = pareto(points)
    assert {p.name for p in front} == _brute_front(points)
    assert [p.speedup for p in front] == sorted(p.speedup for p in front)
    assert len({(p.accuracy, p.speedup) for p in front}) == len(front)


def test_points_from_several_flows_merge():
    quest = [Point("quest#0", 1.0, 1.2), Point("quest#1", 0.7, 3.0)]
    topk = [Point("block_topk#0", 0.95, 2.0), Point("block_topk#1", 0.6, 2.5)]
    assert [p.name for p in pareto(quest + topk)] == ["quest#0", "block_topk#0", "quest#1"]


def test_hypervolume_is_the_staircase_area():
    pts = [Point("a", 1.0, 2.0), Point("b", 0.5, 4.0), Point("c", 0.4, 3.0)]  # c is dominated by b
    # above dense speed (1.0) and zero accuracy: a covers [1, 2] x [0, 1]; b adds [2, 4] x [0, 0.5]
    assert hypervolume(pts) == pytest.approx(1.0 * 1.0 + 2.0 * 0.5)
    assert hypervolume([Point("slow", 1.0, 0.9)]) == 0.0
    assert hypervolume(pts, ref_accuracy=0.5) == pytest.approx(1.0 * 0.5)


def test_wilson_interval():
    lo, hi = wilson_interval(10, 20)
    assert (round(lo, 3), round(hi, 3)) == (0.299, 0.701)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and round(hi, 3) == 0.161
    lo, hi = wilson_interval(20, 20)
    assert round(lo, 3) == 0.839 and hi == 1.0
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


def _row(trial, share, acc, speed, holds=True):
    return {"trial": trial, "share": share, "confirmed_accuracy": acc, "speedup": speed, "holds": holds}


def test_against_defaults_is_the_fastest_held_point_that_reads_no_more_and_beats_them():
    defaults = [_row("quest#0", 0.125, 0.30, 2.27), _row("block_topk#1", 0.125, 0.70, 2.51)]
    held = [_row("block_topk#7", 0.125, 0.98, 1.80), _row("quest#9", 0.125, 0.96, 1.35),
            _row("quest#12", 0.30, 1.0, 2.6),  # faster and better, but reads more K/V: not at their budget
            _row("block_topk#20", 0.06, 0.72, 2.60)]  # beats block_topk's defaults in both
    got = {a["defaults"]: a for a in against_defaults(defaults, held)}
    assert got["quest#0"]["point"] == "block_topk#20" and got["quest#0"]["dominates"]
    assert got["block_topk#1"] == {"defaults": "block_topk#1", "point": "block_topk#20", "share": 0.06,
                                   "defaults_share": 0.125, "accuracy_gain": 0.02,
                                   "speed_ratio": round(2.60 / 2.51, 4), "dominates": True}
    assert against_defaults_lines({"against_defaults": [got["block_topk#1"]]}) == [
        "block_topk#1: block_topk#20 beats them with no more K/V read (6% against 12%): +2 points of confirmed "
        "accuracy, at 1.04× their speed (faster too: it dominates them)"]
    slower = {a["defaults"]: a for a in against_defaults(defaults, held[:2])}
    assert slower["quest#0"]["point"] == "block_topk#7" and not slower["quest#0"]["dominates"]
    assert slower["block_topk#1"]["speed_ratio"] == round(1.80 / 2.51, 4)
    assert against_defaults(defaults, held[2:3])[0]["point"] is None


def test_the_plot_names_the_searched_flows_and_the_frontiers_and_groups_the_other_proposals():
    done = [{"flow": f, "role": "defaults"} for f in ("quest", "tidal")]
    done += [{"flow": f"evo_{i:02d}", "role": "start" if i % 2 else "search"} for i in range(30)]
    named, others = plot_groups(done, [Point("evo_07#3", 0.99, 1.4), Point("quest#12", 0.97, 1.1)])
    assert named == ["evo_07", "quest", "tidal"]
    assert len(others) == 29 and "evo_07" not in others and not set(others) & {"quest", "tidal"}
