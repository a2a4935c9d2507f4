"""The modeled decode speed (`perf.cost.modeled_speedup`, the shipped H200 costs) against GPU-measured
points it was not fitted on (#43, item 3).

The points are the two GPU searches' trials of 2026-11-27 (`data/search_points_h200.json`: Qwen3-8B
shapes at 16 x 32K, pages of 2-32 tokens, units inside pages, two levels, budgets of 2-50%). Each
point was measured twice, in two leases: by the search, and again beside dense by
`benchmarks/bench_costs.py --points`; the measured figure here is the geometric mean of the two.
The two disagree by 2.8% on average and by up to 31% on one point: no model gets closer than its
measurements agree. Alone, the re-measured set gives Spearman 0.992, one point off by 20.5% and
no false speedup; the search's own gives 0.974, one point off by 21.9% and one point modeled
1.07x that measured 0.9994x (BENCHMARKS.md, "An honest modeled speed").

The costs were fitted (`benchmarks/fit_costs.py`) on other shapes only: the test checks that too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune.loader import build_flow
from sparsetune.models.registry import REGISTRY
from sparsetune.perf.cost import Costs, byte_floor_speedup, decode_step_work, field_memory_share, modeled_speedup, topk_lanes

DATA = Path(__file__).with_name("data") / "search_points_h200.json"
ROOT = Path(__file__).resolve().parents[2]


def _points():
    return json.loads(DATA.read_text())["points"]


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def _judge(model) -> dict:
    """The issue's three checks of a speed model over the measured points."""
    measured, modeled = [], []
    for p in _points():
        cfg = REGISTRY[p["model"]].config
        measured.append(math.sqrt(p["search_speedup"] * p["remeasured_speedup"]))
        modeled.append(model(cfg, build_flow(p["flow"], p["params"]), p["batch"], p["context"]))
    errors = [m / g - 1 for m, g in zip(modeled, measured)]
    return {"spearman": spearman(modeled, measured), "max_error": max(abs(e) for e in errors),
            "false_speedups": sum(1 for m, g in zip(modeled, measured) if m > 1 and g < 1), "n": len(measured)}


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_costs_were_fitted_on_other_shapes_than_the_test_points():
    costs = Costs.load()
    assert costs.gpu == "NVIDIA H200" and costs.date and costs.num_sms == 132
    test_shapes = {(p["model"], p["batch"], p["context"]) for p in _points()}
    fitted = set()
    for f in costs.source["files"]:
        fitted |= {(r["model"], r["batch"], r["context"]) for r in json.loads((ROOT / f).read_text())["rows"]}
    assert fitted and not fitted & test_shapes


def test_modeled_speed_ranks_and_fits_unseen_gpu_points():
    costs = Costs.load()
    got = _judge(lambda cfg, flow, b, n: modeled_speedup(cfg, flow, b, n, costs))
    assert got["n"] == 217
    assert got["spearman"] >= 0.9, got
    assert got["false_speedups"] == 0, got  # no point modeled faster than dense that measured slower
    assert got["max_error"] <= 0.20, got  # every modeled figure within 20% of the measured one


def test_bytes_alone_fail_the_same_checks():
    """What the model replaced: bytes alone call slow small-unit points fast (the checks can fail)."""
    got = _judge(lambda cfg, flow, b, n: byte_floor_speedup(cfg, flow, b, n, 2))
    assert got["false_speedups"] > 0 and got["max_error"] > 0.5, got


def test_two_token_units_cost_memory_as_the_issue_counts():
    qwen = REGISTRY["qwen3-8b"].config  # 36 layers, dense layers' fields not kept
    one = build_flow("block_topk", {"block_size": "16", "select_block": "2", "dense_layers": ""})
    assert field_memory_share(qwen, one) == pytest.approx(0.25)  # a mean key per 2 tokens: 1/2 of K, 1/4 of K+V
    quest = build_flow("quest", {"block_size": "16", "select_block": "2", "dense_layers": ""})
    assert field_memory_share(qwen, quest) == pytest.approx(0.5)  # min and max keys
    two = build_flow("block_topk_2l", {"dense_layers": ""})  # 2-token units plus a 16-token page's mean key
    assert field_memory_share(qwen, two) == pytest.approx(0.25 + 1 / 32)
    assert field_memory_share(qwen, None) == 0.0
    fp8 = build_flow("block_topk", {"block_size": "16", "select_block": "2", "dense_layers": "", "field_dtype": "fp8"})
    assert field_memory_share(qwen, fp8) == pytest.approx(0.125)  # the same mean keys in one byte an element


def test_unknown_costs_are_one_clear_error():
    with pytest.raises(SparsetuneError, match="no measured decode costs named 'a100'; known: h200"):
        Costs.load("a100")


def test_step_work_by_hand():
    """What `decode_step_work` counts, against the engine's steps (`FlowAttention.select`)."""
    qwen = REGISTRY["qwen3-8b"].config  # 36 layers, 8 KV heads, head dim 128
    rows = 16 * 8
    assert [topk_lanes(w) for w in (1, 2048, 2058, 16384, 16400)] == [1, 2048, 2064, 16384, 16400]
    one = decode_step_work(qwen, build_flow("block_topk", {"budget_ratio": "0.125", "dense_layers": "0"}), 16, 32768, 132)
    nb = 2048  # 16-token pages
    assert (one.candidates, one.topk_lanes, one.wide_topk, one.launches) == (rows * nb * 35, 2048 * 35, 0, 2 * 35)
    assert one.units == rows * 256 * 35 and one.units_in_pages == 0 and one.dense_pages == rows * nb
    two = decode_step_work(qwen, build_flow("block_topk_2l", {"budget_ratio": "0.125", "dense_layers": "0"}), 16, 32768, 132)
    kept = 512  # coarse 2 x 256 pages, then 2-token units inside them
    assert two.candidates == rows * (nb + kept * 8) * 35 and two.topk_lanes == (2048 + 4096) * 35
    assert two.launches == 5 * 35 and two.units == 0 and two.units_in_pages == rows * 2048 * 35
    wide = decode_step_work(qwen, build_flow("block_topk", {"budget_ratio": "0.125", "select_block": "1"}), 16, 32768, 132)
    assert wide.topk_lanes == 0 and wide.wide_topk == rows * 32768 * 35  # past the radix select's widest row: torch
    shared = decode_step_work(qwen, build_flow("block_topk", {"budget_ratio": "0.125", "dense_layers": "0",
                                                              "select_layers": "1,18"}), 16, 32768, 132)
    assert shared.launches == 2 * 2 and shared.units == one.units  # two layers select, 35 attend
    stream = decode_step_work(qwen, build_flow("streaming", {"dense_layers": ""}), 16, 32768, 132)
    assert (stream.candidates, stream.topk_lanes, stream.launches, stream.field_bytes) == (0, 0, 0, 0)
    assert decode_step_work(qwen, None, 32, 8192, 132).topk_lanes == 0
    waves = decode_step_work(qwen, build_flow("block_topk", {"budget_ratio": "0.125", "dense_layers": "0"}), 32, 32768, 132)
    assert waves.topk_lanes == 2 * one.topk_lanes  # 256 rows: two waves over 132 SMs
