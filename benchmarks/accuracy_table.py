"""Accuracy vs budget: decode flows on the default model over the RULER-style suite (issue #4's bar).

    python benchmarks/accuracy_table.py --contexts 2048,4096 --samples 10 \
        --flows streaming,block_topk,quest,h2o --ratios 0.0625,0.125,0.25 --json-out acc.json

One engine per context (flows are switched on it); each flow run is `sparsetune.eval` with the
dense pass, so every row also carries fidelity to dense on the same prompts. Prints a markdown
table: mean accuracy (% of samples' answers found), relative to dense, and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import sparsetune
from sparsetune.llm import LLM
from sparsetune.evaluation.runner import eval_kv_memory


def budget_params(flow: str, ratio: float, context: int, extra: dict[str, str]) -> dict[str, str]:
    """`budget_ratio` for selecting flows; StreamingLLM keeps only sinks + a window, so its budget
    is the window: `local_blocks` = ratio × blocks of the context − the sink block."""
    if flow == "streaming":
        blocks = math.ceil(ratio * context / int(extra.get("block_size", 16)))
        return {"local_blocks": str(max(1, blocks - int(extra.get("sink_blocks", 1)))), **extra}
    return {"budget_ratio": str(ratio), **extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--flows", default="streaming,block_topk,quest,h2o")
    ap.add_argument("--ratios", default="0.0625,0.125,0.25")
    ap.add_argument("--param", action="append", default=[], help="extra key=value for every flow")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default=None)
    ap.add_argument("--executor", default=None)
    ap.add_argument("--tasks", default=None, help="comma-separated (default: the standard suite)")
    ap.add_argument("--out", default="runs/accuracy")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--skip-dense", action="store_true", help="no dense-only row (each flow row still has dense)")
    args = ap.parse_args()
    extra = dict(p.split("=", 1) for p in args.param)
    tasks = args.tasks.split(",") if args.tasks else None
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
                  executor=args.executor, block_size=int(extra.get("block_size", 16)), kv_memory=eval_kv_memory(args.model, args.batch, ctx, 512, args.device, args.dtype))
        t0 = time.time()
        if not args.skip_dense:
            dense = sparsetune.eval("dense", model=args.model, tasks=tasks, context=ctx, samples=args.samples,
                                    batch=args.batch, out=args.out, llm=llm)
            rows.append({"context": ctx, "flow": "dense", "ratio": 1.0, "result": dense})
            print(f"ctx {ctx} dense: {dense['accuracy']} ({time.time() - t0:.0f}s)", flush=True)
        for flow in args.flows.split(","):
            for ratio in args.ratios.split(","):
                t0 = time.time()
                res = sparsetune.eval(flow, model=args.model, tasks=tasks, context=ctx, samples=args.samples,
                                      params=budget_params(flow, float(ratio), ctx, extra), batch=args.batch,
                                      out=args.out, llm=llm)
                rows.append({"context": ctx, "flow": flow, "ratio": float(ratio), "result": res})
                print(f"ctx {ctx} {flow} {ratio}: acc {res['accuracy']} dense {res['dense_accuracy']} "
                      f"rel {res['relative_accuracy']} fid {res['fidelity']} ({time.time() - t0:.0f}s)", flush=True)
        del llm
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    task_names = list(rows[0]["result"]["tasks"])
    print("\n| context | flow | budget | accuracy % | of dense | top-1 agree % | " + " | ".join(task_names) + " |")
    print("|---" * (6 + len(task_names)) + "|")
    for r in rows:
        res = r["result"]
        rel = res.get("relative_accuracy")
        fid = res.get("fidelity") or {}
        per = " | ".join(f"{100 * res['tasks'][t]['accuracy']:.0f}" for t in task_names)
        budget = "full" if r["flow"] == "dense" else f"1/{round(1 / r['ratio'])}"
        rel_s = "-" if rel is None else f"{100 * rel:.0f}%"
        top1 = "-" if not fid else f"{100 * fid['top1']:.1f}"
        print(f"| {r['context']} | {r['flow']} | {budget} | {100 * res['accuracy']:.1f} | {rel_s} | {top1} | {per} |")


if __name__ == "__main__":
    main()
