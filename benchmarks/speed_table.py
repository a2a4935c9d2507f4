"""Speed of decode flows through `sparsetune.eval --mode speed` (one engine, flows switched on it).

    python benchmarks/speed_table.py --model qwen3-8b --context 32768 --batch 8 --gen 128 \
        --flows block_topk,quest,h2o,streaming --param budget_ratio=0.125 --json-out speed.json

Random weights (speed only). Each flow's row is measured next to dense on the same engine and
prompts (TTFT, decode tokens/s, TPOT p50/p95, peak memory); prints a markdown table.
"""

from __future__ import annotations

import argparse
import json

import sparsetune
from sparsetune.llm import LLM
from sparsetune.evaluation.runner import eval_kv_memory
from sparsetune.loader import get_flow_class


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--flows", default="streaming,block_topk,quest,h2o")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--out", default="runs/speed")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    params = dict(p.split("=", 1) for p in args.param)
    llm = LLM(model=args.model, random_weights=True, max_num_seqs=args.batch,
              kv_memory=eval_kv_memory(args.model, args.batch, args.context, args.gen + 512),
              cuda_graph_batch_sizes=tuple(sorted({1, args.batch})))
    rows = []
    for flow in args.flows.split(","):
        # StreamingLLM refuses a budget (its window is `local_blocks`): it keeps its default window.
        skip = get_flow_class(flow).inapplicable
        res = sparsetune.eval(flow, model=args.model, context=args.context, batch=args.batch, max_new_tokens=args.gen,
                              params={k: v for k, v in params.items() if k not in skip}, mode="speed",
                              random_weights=True, out=args.out, llm=llm)
        rows.append(res)
        print(flow, json.dumps(res["speed"]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{args.model} random weights, {llm.device} {llm.dtype}, batch {args.batch} × {args.context}, "
          f"{args.gen} new tokens, params {params}")
    print("| flow | TTFT p50 s | decode tok/s | TPOT p50 ms | TPOT p95 ms | dense TPOT p50 ms | decode speedup | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for res in rows:
        s, d = res["speed"]["flow"], res["speed"]["dense"]
        print(f"| {res['flow']} | {s['ttft_s']['p50']:.2f} | {s['decode_tokens_per_s']:.0f} | {s['tpot_ms']['p50']:.2f} | "
              f"{s['tpot_ms']['p95']:.2f} | {d['tpot_ms']['p50']:.2f} | {res['speed']['decode_speedup']:.2f}× | "
              f"{s['peak_memory_bytes'] / 2**30:.1f} |")


if __name__ == "__main__":
    main()
