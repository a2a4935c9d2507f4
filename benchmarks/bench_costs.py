"""Decode step times that the cost model's per-operation costs are fitted on (issue #43, item 3).

    python benchmarks/bench_costs.py --model qwen3-8b --shapes 16x16384,8x32768,32x8192 --json-out costs.json

For each shape (`batch x context`) one speed engine (`perf.speed.speed_engine`, the search's
measured speed) times a grid of decode flows that spans what the model counts: pages of 2-32
tokens, units inside pages, two levels at several `coarse`, budgets from 3% to 50%, dense layers,
and dense at each page size, every step as the search times it (`decode_step_seconds`, CUDA
graphs). A config that cannot run (its fields do not fit) is recorded with its error. The shapes
are not the search's 16 x 32K: the search's own points are what the fitted model is tested on
(`benchmarks/fit_costs.py`, `tests/perf/test_cost_model.py`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsetune.perf.speed import decode_step_seconds, speed_engine

# name -> [(flow, params)], grouped by page size, so the pool is laid out again only when the page changes.
GRIDS: dict[str, list[tuple[str, dict[str, str]]]] = {"main": [], "wide": []}


def _add(flow: str, grid: str = "main", **params) -> None:
    GRIDS[grid].append((flow, {k: str(v) for k, v in params.items()}))


for bs in (2, 4, 8, 32):
    _add("block_topk", block_size=bs, budget_ratio=0.125)
    _add("quest", block_size=bs, budget_ratio=0.125)
_add("block_topk", block_size=2, budget_ratio=0.3, dense_layers="0,1")
_add("quest", block_size=2, budget_ratio=0.3, sink_blocks=3, local_blocks=7)
_add("block_topk", block_size=4, budget_ratio=0.06)
_add("quest", block_size=4, budget_ratio=0.2, dense_layers="0,1,2")
for r in (0.03, 0.06, 0.125, 0.25, 0.4):
    _add("block_topk", block_size=16, budget_ratio=r)
_add("block_topk", block_size=16, budget_ratio=0.125, dense_layers="0,1,2,3")
for r in (0.125, 0.3):
    _add("quest", block_size=16, budget_ratio=r)
for sb in (2, 4, 8):
    _add("block_topk", block_size=16, select_block=sb, budget_ratio=0.125)
_add("quest", block_size=16, select_block=4, budget_ratio=0.2)
for sb in (2, 4):
    for c in (1.5, 2, 4):
        _add("block_topk_2l", select_block=sb, coarse=c, budget_ratio=0.125)
    _add("quest_2l", select_block=sb, coarse=2, budget_ratio=0.125)
    _add("quest_2l", select_block=sb, coarse=4, budget_ratio=0.06)
_add("block_topk_2l", select_block=2, coarse=2, budget_ratio=0.06)
_add("block_topk_2l", select_block=2, coarse=2, budget_ratio=0.3, sink_blocks=2, local_blocks=6)
_add("block_topk_2l", select_block=2, coarse=6, budget_ratio=0.3)
_add("block_topk_2l", select_block=4, coarse=8, budget_ratio=0.4, dense_layers="0,1,2")
_add("quest_2l", select_block=2, coarse=6, budget_ratio=0.45)
_add("quest_2l", select_block=4, coarse=3, budget_ratio=0.3, sink_blocks=3, local_blocks=7)
# 1-token units: rows past the radix select's widest (torch's top-k instead) at the longer contexts
_add("block_topk", "wide", block_size=16, select_block=1, budget_ratio=0.125)
_add("block_topk_2l", "wide", select_block=1, coarse=2, budget_ratio=0.125)
_add("quest_2l", "wide", select_block=1, coarse=2, budget_ratio=0.125)
_add("quest_2l", "wide", select_block=1, coarse=1.5, budget_ratio=0.4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--shapes", default="16x16384,8x32768,32x8192")
    ap.add_argument("--grids", default="main,wide", help=f"which of {', '.join(GRIDS)}")
    ap.add_argument("--points", default=None,
                    help="time these points instead of the grids: a JSON file of {'points': [{'flow', 'params'}, ...]} "
                         "(the search's, to test the model on: tests/perf/data)")
    ap.add_argument("--part", default="1/1", help="i/n: the i-th of n slices of the points (one device call each)")
    ap.add_argument("--limit", type=int, default=None, help="the first N grid configs only (a smoke run)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = []
    out = Path(args.json_out) if args.json_out else None
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        t0 = time.perf_counter()
        llm = speed_engine(args.model, True, batch, context)
        dense: dict[int, float] = {}
        if args.points:
            pts = json.loads(Path(args.points).read_text())["points"]
            i, n = (int(x) for x in args.part.split("/"))
            grid = [(p["flow"], p["params"]) for p in pts][i - 1::n]
            grid.sort(key=lambda c: int(c[1].get("block_size", 16)))  # one pool layout per page size
        else:
            grid = [c for g in args.grids.split(",") for c in GRIDS[g]]
        for flow, params in grid[:args.limit]:
            row = {"model": args.model, "batch": batch, "context": context, "flow": flow, "params": params}
            try:
                llm.apply(llm.setup.with_flow(flow, params, defaults="published"))
                step = decode_step_seconds(llm, batch, context)
                bs = llm.engine.kv.block_size
                if bs not in dense:
                    llm.apply(llm.setup.dense())
                    dense[bs] = decode_step_seconds(llm, batch, context)
                row.update(page=bs, step_ms=round(step * 1e3, 4), dense_ms=round(dense[bs] * 1e3, 4),
                           speedup=round(dense[bs] / step, 4))
            except Exception as e:  # noqa: BLE001 - recorded: the fit skips it
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                if not llm.engine.has_pool:
                    llm = speed_engine(args.model, True, batch, context)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write_text(json.dumps({"device": name, "rows": rows, "args": vars(args)}, indent=1))
        print(f"# {shape}: {time.perf_counter() - t0:.0f} s", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
