"""Accuracy of reuse flows on the `rag` workload at an equal recomputation budget (issue #5's bar).

    python benchmarks/reuse_table.py --contexts 2048,4096 --samples 20 --ratio 0.15

One engine per context; each row is `sparsetune.eval --task rag --reuse FLOW`: the documents are
stored one by one (stage 1), then each measured request reuses them (stage 2); every row also runs
the reference (full attention, every token computed) on the same prompts. The budget: `ratio` of
the reused tokens for cacheblend, a3 and sparsex (sparsex adds its overflow and tail tokens on
top), and for epic the first `ratio` of each document (k = ratio x the mean document length).
"""

from __future__ import annotations

import argparse
import json

import sparsetune
from sparsetune.llm import LLM
from sparsetune.flow.params import parse_flow_param_args
from sparsetune.evaluation.reuse_tasks import REUSE_TASKS
from sparsetune.evaluation.runner import eval_kv_memory

FLOWS = "full_recompute,sparsex,a3,cacheblend,epic,pie,naive_reuse"


def budget(flow: str, ratio: float, context: int, task: str = "rag") -> dict[str, str]:
    if flow in ("cacheblend", "a3", "sparsex"):
        return {"ratio": str(ratio)}
    if flow == "epic":
        return {"k": str(max(1, round(ratio * 0.93 * context / REUSE_TASKS[task].count)))}  # segments hold ~93% of the prompt
    return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--flows", default=FLOWS)
    ap.add_argument("--task", default="rag", help="rag, chat or agent")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--param", action="append", default=[], help="flow:key=value (repeatable)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="runs/reuse")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    extra = parse_flow_param_args(args.param)
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        # The pool holds the batch's prompts and the documents they reuse.
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                  kv_memory=eval_kv_memory(args.model, args.batch, ctx, 64, args.device, args.dtype, segments=True))
        for flow in args.flows.split(","):
            params = {**budget(flow, args.ratio, ctx, args.task), **extra.get(flow, {})}
            res = sparsetune.eval(model=args.model, tasks=[args.task], context=ctx, samples=args.samples,
                                  batch=args.batch, out=args.out, reuse=flow, reuse_params=params, llm=llm)
            rows.append({"context": ctx, "flow": flow, "params": params, "result": res})
            print(f"ctx {ctx} {flow} {params}: acc {res['accuracy']} ref {res['dense_accuracy']} "
                  f"reuse {res['reuse']} fid {res['fidelity']}", flush=True)
        del llm
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    print(f"\ntask {args.task}\n| context | flow | params | accuracy % | of reference | top-1 agree % | recomputed % of reused | "
          "token-layers % | TTFT p50 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        res, ru = r["result"], r["result"]["reuse"]
        rel = res.get("relative_accuracy")
        fid = res.get("fidelity") or {}
        top1 = "-" if not fid else f"{100 * fid['top1']:.1f}"
        print(f"| {r['context']} | {r['flow']} | {', '.join(f'{k}={v}' for k, v in r['params'].items()) or '-'} | "
              f"{100 * res['accuracy']:.1f} | {'-' if rel is None else f'{100 * rel:.0f}%'} | "
              f"{top1} | {100 * ru['recompute_ratio']:.1f} | "
              f"{100 * ru['compute_fraction']:.1f} | {ru['ttft_p50_s']:.3f} |")


if __name__ == "__main__":
    main()
