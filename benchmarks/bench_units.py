"""Decode step time of selection units inside pages against small pages and dense (issue #43).

    python benchmarks/bench_units.py --model qwen3-8b --batch 16 --context 32768 --flows block_topk,quest \
        --configs 16,16:2,16:4,2 --param budget_ratio=0.125 --json-out units.json

A config is `page` (the flow's blocks are the KV pages and its selection unit), `page:unit` (units
of `select_block` tokens inside pages) or `page:unit:coarse` (two levels: the best coarse x budget
pages first, then units inside them). Each flow step is `perf.speed.decode_step_seconds` (the
search's measured speed: requests on blocks of whatever KV the pool holds, the flow's fields built
over them, CUDA-graph steps), beside dense on the same engine at the same page size, so every ratio
is measured side by side. `--profile`: also break one eager step of each config into stages and kernels
(`perf.step_profile.profile_decode`: the indexer, the top-k, attention, ...; it prefills the
requests for real).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsetune.flow.params import parse_param_args
from sparsetune.llm import LLM
from sparsetune.perf.speed import decode_step_seconds
from sparsetune.perf.step_profile import profile_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--flows", default="block_topk,quest")
    ap.add_argument("--configs", default="16,16:2,2")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's longest sequence (its graphs' table width); default the model's")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    extra = parse_param_args(args.param)
    # The pool holds the timed requests' K and V (as the search's speed engine sizes it); a flow's
    # fields come on top (per unit: 8x a 16-token block's at 2-token units).
    from sparsetune.models.resolve import model_config

    per_token = model_config(args.model, True)[1].kv_bytes_per_token(2)
    llm = LLM(model=args.model, random_weights=True, max_num_seqs=args.batch, cuda_graph_batch_sizes=(args.batch,),
              kv_memory=args.batch * (args.context + 64) * per_token, max_model_len=args.max_model_len)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} random weights on {name}, {args.batch} x {args.context}, {extra}", flush=True)
    dense: dict[int, float] = {}
    rows = []
    for cfg in args.configs.split(","):
        page, unit, coarse = (cfg.split(":") + ["", ""])[:3]
        for flow in args.flows.split(","):
            params = {**extra, "block_size": page, **({"select_block": unit} if unit else {}),
                      **({"coarse": coarse} if coarse else {})}
            llm.apply(llm.setup.with_flow(flow, params, defaults="published"))
            ran = llm.flow  # as applied: a two-level flow's own unit and coarse where the config leaves them
            step = decode_step_seconds(llm, args.batch, args.context)
            prof = None
            if args.profile:
                prof = profile_decode(llm, args.batch, args.context, steps=3)
            bs = llm.engine.kv.block_size
            if bs not in dense:
                llm.apply(llm.setup.dense())
                dense[bs] = decode_step_seconds(llm, args.batch, args.context)
            row = {"flow": flow, "page": int(page), "unit": ran.unit, "coarse": ran.coarse,
                   "step_ms": round(step * 1e3, 3),
                   "dense_ms": round(dense[bs] * 1e3, 3), "speedup": round(dense[bs] / step, 3),
                   "profile": None if prof is None else {k: v["ms"] for k, v in prof["categories"].items()},
                   "kernels": None if prof is None else {k: v["top"] for k, v in prof["categories"].items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| flow | page | unit | coarse | step ms | dense ms | speedup |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['flow']} | {r['page']} | {r['unit']} | {r['coarse'] or '-'} | {r['step_ms']:.2f} | {r['dense_ms']:.2f} "
              f"| {r['speedup']:.2f}x |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"device": name, "rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
