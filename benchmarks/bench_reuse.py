"""Time to first token of reuse flows against full recompute on one long prompt (issue #5's bar).

    python benchmarks/bench_reuse.py --model qwen3-8b --context 32768 --reuse-ratio 0.9 \
        --flows full_recompute,pie,cacheblend,sparsex --param sparsex:boundary_layer=2

The prompt is a plain prefix, `--segments` reusable segments and a plain question; the segments
hold `--reuse-ratio` of the tokens. `--rows torch,kernels` times every flow both ways in one run:
the recomputed rows' attention in the torch path (gathered keys, SDPA with masks) and in
`kernels/rows_attention` (the engine's CUDA path). Each row's compute floor: the plan's matmul
FLOPs (`perf.cost.prefill_flops` of the token-layers, MLP rows and attended pairs the executor
counted) at the bf16 GEMM rate measured in the same run; "ceiling" is full recompute's FLOPs over
the plan's, the most any kernel can give at this budget. Stage 1 (cache building) prefills it once with `pie`, which
stores the segments; stage 2 times each flow's reuse prefill on the same prompt (the segments hit).
Random weights: the byte tokenizer makes one token per character, so the lengths are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import sparsetune.engine.rows as engine_rows
from sparsetune.llm import LLM
from sparsetune.flow.params import parse_flow_param_args
from sparsetune.engine.sequence import SamplingParams
from sparsetune.perf.cost import full_prefill_flops, prefill_flops
from sparsetune.perf.speed import reuse_prompt, reuse_ttft_seconds, store_segments


def print_gpu_gaps(prof, top: int = 12) -> None:
    """Where the GPU waits within the profiled request: its busy time (kernels and copies, overlaps
    merged) against their span, and the longest idle gaps with the work on either side."""
    from torch.autograd import DeviceType

    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA), key=lambda x: x[0])
    if not ev:
        return
    gaps, busy, end, last = [], 0.0, ev[0][0], ev[0][2]
    for a, b, name in ev:
        if a > end:
            gaps.append((a - end, last, name, a))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, last = b, name
    span = end - ev[0][0]
    print(f"GPU busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span; idle {sum(g[0] for g in gaps) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps; the longest:")
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    for i, (g, before, after, at) in enumerate(sorted(gaps, reverse=True)[:top]):
        print(f"  {g / 1e3:7.2f} ms  after {before[:50]}  before {after[:50]}")
        if i < 3:  # what the host ran meanwhile: the longest ops that began in the gap, with their code
            inside = sorted((e for e in cpu if at - g <= e.time_range.start < at),
                            key=lambda e: e.time_range.end - e.time_range.start, reverse=True)[:4]
            for e in inside:
                frames = [f for f in (e.stack or []) if "sparsetune" in f][:2]
                print(f"      {(e.time_range.end - e.time_range.start) / 1e3:6.2f} ms {e.name[:40]} {' < '.join(frames)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--reuse-ratio", type=float, default=0.9)
    ap.add_argument("--segments", type=int, default=9)
    ap.add_argument("--flows", default="full_recompute,pie,cacheblend,sparsex")
    ap.add_argument("--param", action="append", default=[], help="flow:key=value (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--profile", action="store_true", help="print each flow's 30 costliest kernels and ops by their own GPU time (torch profiler), and the GPU's idle gaps")
    ap.add_argument("--rows", default="kernels", help="the rows' attention: kernels, torch, or both (torch,kernels)")
    args = ap.parse_args()
    paths = args.rows.split(",")
    if not set(paths) <= {"torch", "kernels"}:
        ap.error(f"--rows {args.rows}: use kernels, torch or torch,kernels")
    params = parse_flow_param_args(args.param)
    default_path = engine_rows.use_kernels
    llm = LLM(model=args.model, random_weights=True, dtype=args.dtype, max_num_seqs=1, cuda_graph=False)
    parts = reuse_prompt(args.context, args.reuse_ratio, args.segments)
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    first = store_segments(llm, parts)  # stage 1: the cache-building request stores every segment
    print(f"stage 1: {first['prompt_tokens']} tokens, {first['segment_misses']} segments stored "
          f"({first['seconds']:.3f} s)", flush=True)
    rows = []
    for flow in args.flows.split(","):
        llm.use_reuse(flow, params.get(flow))
        for path in paths:
            engine_rows.use_kernels = (lambda q: q.is_cuda) if path == "kernels" else (lambda q: False)
            ttft, last = reuse_ttft_seconds(llm, parts, args.repeats)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                    llm.generate([parts], once, chat=False)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
                print_gpu_gaps(prof)
            flops = prefill_flops(llm.model_config, last["token_layers"], last["mlp_token_layers"], last["attention_pairs"])
            row = {"flow": flow, "rows": path, "params": llm.reuse_flow.params(), "ttft_s": ttft, "flops": flops,
                   **{k: last[k] for k in ("prompt_tokens", "reuse_ratio", "recompute_ratio", "compute_fraction",
                                           "segment_hits", "attention_pairs")}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    engine_rows.use_kernels = default_path
    # The engine's own chunked prefill of the same tokens (no reuse path), for reference.
    llm.use_reuse(None)
    llm.generate([parts], once, chat=False)
    times = []
    for _ in range(args.repeats):
        llm.stats.first_token_seconds.clear()
        llm.generate([parts], once, chat=False)
        times.append(llm.stats.first_token_seconds[0])
    engine = statistics.median(times)
    # One baseline for every row: the fastest full recompute of the run (else the engine's chunked prefill)
    fulls = [r["ttft_s"] for r in rows if r["flow"] == "full_recompute"]
    base, base_name = (min(fulls), "full_recompute") if fulls else (engine, "engine prefill")
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    full = full_prefill_flops(llm.model_config, first["prompt_tokens"])
    peak = None
    if torch.cuda.is_available():
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import measure_matmul_flops

        peak = measure_matmul_flops()
    print(f"\n{args.model} random weights, {dev} {llm.dtype}, {first['prompt_tokens']} tokens, "
          f"{args.reuse_ratio:.0%} in {args.segments} reused segments; engine prefill TTFT {engine:.3f} s")
    print(f"full prefill {full / 1e12:.1f} TFLOP; bf16 GEMM rate " + (f"{peak / 1e12:.0f} TFLOP/s (measured)" if peak else "not measured (no GPU)"))
    print(f"| flow | rows' attention | TTFT s | vs {base_name} | recomputed share of reused | token-layers computed "
          "| FLOPs (share) | ceiling | floor s | % of floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r["flop_share"], r["ceiling"] = r["flops"] / full, full / r["flops"]
        r["floor_s"] = r["flops"] / peak if peak else None
        floor = f"{r['floor_s']:.3f} | {r['floor_s'] / r['ttft_s']:.0%}" if peak else "— | —"
        print(f"| {r['flow']} | {r['rows']} | {r['ttft_s']:.3f} | {base / r['ttft_s']:.2f}x | "
              f"{r['recompute_ratio']:.1%} | {r['compute_fraction']:.1%} | {r['flops'] / 1e12:.1f} T ({r['flop_share']:.1%}) | "
              f"{r['ceiling']:.2f}x | {floor} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "engine_prefill_ttft_s": engine, "full_prefill_flops": full,
                       "matmul_flops_per_s": peak}, f, indent=1)


if __name__ == "__main__":
    main()
