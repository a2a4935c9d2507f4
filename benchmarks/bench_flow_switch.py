"""What switching the decode flow of a warm engine costs: 50 parameter sets of quest and block_topk.

    python benchmarks/bench_flow_switch.py --model qwen3-8b --batch 8 --context 4096 --json-out switch.json
    python benchmarks/bench_flow_switch.py --rebuild ...   # the same switches, each building a new backend

A search worker runs thousands of trials on one engine, each an `LLM.apply` of the trial's setup
(resolved before, `Setup.with_flow`: timed apart as `resolve_ms`). The engine keeps
what a switch leaves valid: a flow of the loaded backend's kernel key (budget, sink and local
blocks, dense and select layers differ) is retuned in place; graphs are recaptured only when the
routing or the selection width (blocks per row, a shape inside the graphs) changed. Each switch
is timed (`apply`, then the first decode steps after it, where a lazy compile would land) and
its Triton compiles (`triton.knobs.compilation.listener`), dynamo graphs
(`torch._dynamo.utils.counters`) and eager fallbacks (frames dynamo gave up on) are counted.
`--rebuild` drops the backend before each switch: the cost of building one for every trial.
Random weights (speed only); on CPU the reference executor runs and there are no graphs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from sparsetune.engine.sequence import SamplingParams
from sparsetune.llm import LLM
from sparsetune.perf.timing import sync

def param_sets(budget: int) -> list[tuple[str, dict[str, str]]]:
    """50 switches: quest and block_topk alternate in runs of 5. A run is [base, variant, variant,
    next base, variant]: a base sets the shapes (budget in blocks, budget_ratio, dense layers), a
    variant changes only sink/local blocks or the budget within the same number of blocks. So each
    run has one flow change, one shape change inside the flow, and three switches that change no
    shape."""
    bases = [{"budget": str(budget)}, {"budget": str(budget // 2)}, {"budget_ratio": "0.125"},
             {"budget": str(budget), "dense_layers": "0,1,2,3"}, {"budget": str(budget * 2)}]
    variants = [{"sink_blocks": "2", "local_blocks": "2"}, {"sink_blocks": "0", "local_blocks": "1"},
                {"sink_blocks": "4", "local_blocks": "8"}, {"local_blocks": "16"}, {"sink_blocks": "1", "local_blocks": "2"}]
    out = []
    for run in range(10):
        name = "quest" if run % 2 == 0 else "block_topk"
        base, following = bases[run % 5], bases[(run + 1) % 5]
        less = {"budget": str(int(base["budget"]) - 7)} if "budget" in base else {}  # same blocks, 7 tokens fewer
        out += [(name, base), (name, {**base, **variants[run % 5]}), (name, {**base, **less}), (name, following),
                (name, {**following, **variants[(run + 2) % 5]})]
    return out


def what_changed(llm: LLM, before, after) -> str:
    """What a switch from flow `before` to `after` changes: the flow (class or a stage param), a
    shape (the selection width, blocks per row of the widest block table), the routed layers, or
    none of these."""
    if before is None or before.kernel_key() != after.kernel_key():
        return "flow"
    width = llm.engine.runner.max_blocks_per_seq  # `FlowAttention.selection_width` of a flow that scores blocks
    if before.attended_blocks(width) != after.attended_blocks(width):
        return "selection width"
    if (before.dense_layers, before.select_layers) != (after.dense_layers, after.select_layers):
        return "layers"
    return "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4, help="decode steps after each switch")
    ap.add_argument("--rebuild", action="store_true", help="build a new backend at every switch (the old behaviour)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import triton

    compiles: list[bool] = []
    triton.knobs.compilation.listener = lambda **kw: compiles.append(bool(kw.get("cache_hit")))
    dtype = "bfloat16" if torch.cuda.is_available() and args.device != "cpu" else "float32"
    llm = LLM(model=args.model, random_weights=True, dtype=dtype, device=args.device, max_num_seqs=args.batch,
              max_model_len=args.context + args.steps + 64, max_num_batched_tokens=args.context * args.batch,
              cuda_graph_batch_sizes=(1, args.batch), flow="quest", params={"budget": str(args.budget)})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 1000, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    sampling = SamplingParams(max_tokens=args.steps, ignore_eos=True)

    def decode() -> float:
        """The prompts' prefill, then `steps` decode steps; the median decode step's seconds."""
        seqs = [llm.engine.add_request(p, sampling) for p in prompts]
        llm.engine.run_to_completion(prompts, seqs)
        stamps = seqs[0].events.tokens  # each token of the first request: one per step
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else float("nan")

    for name in ("quest", "block_topk", "quest"):  # warm: both flows' kernels compiled once
        llm.apply(llm.setup.with_flow(name, {"budget": str(args.budget)}))
        decode()
    print(f"{args.model} on {llm.device}, batch {args.batch} x {args.context}, graphs for {llm.engine.graph_batch_sizes}, "
          f"executor {llm.engine.backends[-1].executor}", file=sys.stderr, flush=True)

    rows = []
    for i, (name, params) in enumerate(param_sets(args.budget)):
        if args.rebuild:
            llm._flow_backend = None  # noqa: SLF001 - the benchmark's baseline: no backend to retune
        before_flow, before_backend, before_graph = llm.flow, llm.engine.backends[-1], llm.engine.decode_graph(1)
        n_compiles, graphs = len(compiles), counters["stats"]["unique_graphs"]
        frames = counters["frames"]["total"] - counters["frames"]["ok"]
        t_resolve = time.perf_counter()
        setup = llm.setup.with_flow(name, params)  # resolved once, at the API boundary (no GPU work)
        resolve_s = time.perf_counter() - t_resolve
        sync(llm.device)
        t0 = time.perf_counter()
        llm.apply(setup)
        sync(llm.device)
        switch_s = time.perf_counter() - t0
        step_s = decode()
        kind = ("rebuild" if llm.engine.backends[-1] is not before_backend else
                "recapture" if llm.engine.decode_graph(1) is not before_graph else "retune")
        row = {"switch": i, "flow": name, "params": params, "changes": what_changed(llm, before_flow, llm.flow),
               "kind": kind, "switch_ms": switch_s * 1e3, "resolve_ms": resolve_s * 1e3,
               "step_ms_after": step_s * 1e3, "triton_compiles": sum(not hit for hit in compiles[n_compiles:]),
               "triton_cache_loads": sum(compiles[n_compiles:]),
               "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs,
               "eager_fallbacks": counters["frames"]["total"] - counters["frames"]["ok"] - frames,
               "graphs_used": llm.engine.uses_graphs}
        rows.append(row)
        print(f"{i:2d} {name:10s} {row['changes']:15s} {kind:9s} {row['switch_ms']:8.1f} ms  step {row['step_ms_after']:6.2f} ms  "
              f"triton {row['triton_compiles']}+{row['triton_cache_loads']} dynamo {row['dynamo_graphs']} "
              f"eager {row['eager_fallbacks']}  {params}", file=sys.stderr, flush=True)

    summary = {}
    for changes in ("none", "selection width", "layers", "flow"):
        rs = [r for r in rows if r["changes"] == changes]
        if rs:
            summary[changes] = {"switches": len(rs), "kinds": sorted({r["kind"] for r in rs}),
                                "median_ms": statistics.median(r["switch_ms"] for r in rs),
                             "max_ms": max(r["switch_ms"] for r in rs),
                             "resolve_median_ms": statistics.median(r.get("resolve_ms", 0.0) for r in rs),
                             "triton_compiles": sum(r["triton_compiles"] for r in rs),
                             "dynamo_graphs": sum(r["dynamo_graphs"] for r in rs),
                             "eager_fallbacks": sum(r["eager_fallbacks"] for r in rs)}
    for changes, s in summary.items():
        print(f"changes {changes:15s} x{s['switches']:2d} ({'/'.join(s['kinds'])}): median {s['median_ms']:.1f} ms, max {s['max_ms']:.1f} ms; "
              f"triton compiles {s['triton_compiles']}, dynamo graphs {s['dynamo_graphs']}, "
              f"eager fallbacks {s['eager_fallbacks']}", flush=True)
    result = {"model": args.model, "device": str(llm.device),
              "gpu": torch.cuda.get_device_name() if llm.device.type == "cuda" else None, "torch": torch.__version__,
              "batch": args.batch, "context": args.context, "budget": args.budget, "rebuild": args.rebuild,
              "summary": summary, "switches": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
