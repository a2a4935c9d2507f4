"""Engine speed on one GPU: decode step time vs the byte floor, prefill throughput vs the FLOP floor.

    python benchmarks/bench_engine.py --model qwen3-8b --decode 8x32768,16x16384,16x32768 \
        --prefill 1x32768,8x32768 --json-out engine.json

Decode cases start from a KV pool filled with random values (as if each sequence
had been prefilled to the context length) and time `LLM.step()` end to end:
host-side scheduling, the CUDA-graph replay of all layers, and sampling.
Prefill cases time `LLM.generate(max_tokens=1)` on random token ids (TTFT), and the same with the
last layer run over every row (`ModelRunner.skip_unused_rows = False`) side by side.
Random bf16 weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import measure_copy_bandwidth, measure_matmul_flops  # noqa: E402

from sparsetune.flow.compile import indexer as indexer_mod  # noqa: E402
from sparsetune.kernels import paged_decode  # noqa: E402
from sparsetune.llm import LLM  # noqa: E402
from sparsetune.engine.sequence import SamplingParams  # noqa: E402
from sparsetune.perf.cost import decode_step_bytes, full_prefill_flops  # noqa: E402
from sparsetune.perf.step_profile import profile_call, profile_decode  # noqa: E402
from sparsetune.perf.timing import time_call, time_calls  # noqa: E402


def graph_twin(name: str) -> str:
    """A copy of built-in flow `name` as a user's own file (`<name>_graph`): untrusted, so it runs as
    op graphs traced in the sandbox (`registry`), the way a downloaded flow file runs. Where the jail
    cannot isolate (some containers), the graphs are traced here from the built-in class, the same
    `describe` the child runs, and stored where the child's answer would be."""
    from sparsetune import loader
    from sparsetune.errors import SparsetuneError
    from sparsetune.flow.graph import describe

    src = loader.flow_path(name).read_bytes().replace(f'name = "{name}"'.encode(), f'name = "{name}_graph"'.encode(), 1)
    path = Path(tempfile.gettempdir()) / f"{name}_graph.py"
    path.write_bytes(src)
    try:
        loader.load_file(path)
        print(f"{name}_graph: traced in the sandbox", flush=True)
    except SparsetuneError as e:
        import hashlib

        _, cached = loader.trace_request(hashlib.sha256(src).hexdigest(), {})
        cached.parent.mkdir(mode=0o700, exist_ok=True)
        cached.write_text(json.dumps(describe(loader.load_file(path, trust=True), {})))
        loader._LOADED.clear()
        print(f"{name}_graph: the sandbox refused ({e}); graphs traced in this process", flush=True)
    return str(path)


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",") if c]  # type: ignore[misc]


def prefill_flops(llm: LLM, n: int, every_row: bool = True) -> float:
    """FLOPs of an n-token prefill (`perf.cost.full_prefill_flops` plus the LM head on the last token).
    every_row=False: the work the engine does, whose last layer runs attention, o_proj and the MLP on
    the last token only (its q/k/v projection on every token)."""
    c = llm.model_config
    total = full_prefill_flops(c, n) + 2 * c.hidden_size * c.vocab_size
    if every_row:
        return total
    hq, hd, d = c.num_attention_heads, c.head_dim, c.hidden_size
    skipped_rows = n - 1  # of the last layer: o_proj, the MLP, and the attention of every row but the last
    return total - 2 * (hq * hd * d + 3 * d * c.intermediate_size) * skipped_rows - 4 * hd * hq * (n * (n + 1) / 2 - n)


def decode_case(llm: LLM, batch: int, ctx: int, steps: int) -> dict:
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    seqs = []
    for _ in range(batch):  # the pool holds (random) KV for every earlier position
        s = llm.engine.reserve(torch.randint(0, vocab, (ctx,)).tolist(), params)
        llm.engine.admit_prefilled(s)
        seqs.append(s)
    for _ in range(3):
        llm.engine.step()
    per_step = time_call(lambda: [llm.engine.step() for _ in range(steps)], llm.device) / steps
    # The graph replay alone (no host work), for the split of where time goes.
    g = llm.engine.decode_graph(batch)
    replay = None if g is None else statistics.median(time_calls(g.replay, llm.device, steps, events=True))
    for s in seqs:
        llm.engine.abort(s)
    ctx_avg = int(ctx + 3 + steps / 2)
    step = decode_step_bytes(llm.model_config, llm.flow, batch, ctx_avg, llm.dtype.itemsize)
    wb, kb = step.weights, step.kv + step.fields
    return {"flow": llm.flow_name, "batch": batch, "context": ctx, "step_ms": per_step * 1e3, "graph_replay_ms": None if replay is None else replay * 1e3,
            "weight_bytes": wb, "kv_bytes": kb}


def by_category(prof: dict) -> list[tuple[str, float]]:
    return sorted(((c, v["ms"]) for c, v in prof["categories"].items()), key=lambda kv: -kv[1])


def profile_prefill(llm: LLM, tokens: int) -> list[tuple[str, float]]:
    """GPU kernel time by category (sparsetune.perf.step_profile) of one prefill of random tokens
    through the engine (a one-token request: its chunked prefill and first token; prefill runs
    eagerly), after a warm-up prefill of other random tokens."""
    vocab = llm.model_config.vocab_size

    def prefill() -> None:
        llm.generate([torch.randint(0, vocab, (tokens,)).tolist()], SamplingParams(max_tokens=1, ignore_eos=True),
                     chat=False)

    prefill()  # warm-up
    return by_category(profile_call(prefill, llm.device))


@torch.inference_mode()
def _prefill_fields(llm: LLM, dec: list[tuple[int, int]]) -> None:
    """Run the flow's cache stage over the whole pool once, as prefill would have for real prompts."""
    blocks = torch.arange(llm.engine.kv.num_blocks, device=llm.device)
    for layer, backend in enumerate(llm.engine.backends):
        if getattr(backend, "flow", None) is not None:
            for chunk in blocks.split(4096):
                backend.rebuild_fields(layer, llm.engine.kv, chunk, chunk.numel() * llm.engine.kv.block_size)  # all full blocks
    torch.cuda.synchronize()


# Kernel settings `--variants` switches between: module attributes and their values ("now": the
# library's own, read at import).
_BEFORE = {(indexer_mod, "DOT_PRODUCTS"): False, (paged_decode, "_SPARSE_PROGRAMS_PER_SM"): 16,
           (paged_decode, "_SPARSE_MIN_TOKENS_PER_SPLIT"): 512}
VARIANTS = {"now": {key: getattr(*key) for key in _BEFORE}, "before": _BEFORE}


def set_variant(name: str) -> bool:
    """Apply a `VARIANTS` entry; whether anything changed (captured graphs then hold the old kernels)."""
    changed = False
    for (mod, attr), value in VARIANTS[name].items():
        changed |= getattr(mod, attr) != value
        setattr(mod, attr, value)
    return changed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--decode", default="8x32768,16x16384,16x32768")
    ap.add_argument("--prefill", default="1x32768,8x32768")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", default="8x32768", help="decode case to break down by kernel ('' to skip)")
    ap.add_argument("--flows", default="dense", help="comma-separated decode flows to compare on the same engine")
    ap.add_argument("--param", action="append", default=[], help="flow parameter key=value for the sparse flows")
    ap.add_argument("--profile-prefill", type=int, default=32768, help="prompt length to break down (0 to skip)")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="prefill chunk (the engine's max_num_batched_tokens); 0: the longest prompt, unchunked")
    ap.add_argument("--variants", default="now",
                    help="kernel settings to time each flow under, comma-separated, in one process (the graphs "
                         "recaptured in between): now, or before (the indexer's products without tensor cores, "
                         "sparse attention split as dense rows: #17's state before 2026-11-26d)")
    ap.add_argument("--graph-twins", action="store_true",
                    help="after each sparse flow, time its copy as a user's file: op graphs replayed (issue #40)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants {args.variants!r}: each one of {', '.join(VARIANTS)}")

    dec, pre = parse_cases(args.decode), parse_cases(args.prefill)
    bw, flops = measure_copy_bandwidth(), measure_matmul_flops()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", flush=True)

    max_b = max([b for b, _ in dec] + [b for b, _ in pre] + [1])
    max_ctx = max([c for _, c in dec] + [c for _, c in pre])
    tokens_needed = max((b * (c + args.steps + 16) for b, c in dec), default=0)
    blocks = max(tokens_needed, max_ctx + 64) // 16 + 2 * max_b + 64
    llm = LLM(
        model=args.model, random_weights=True, dtype=args.dtype, num_kv_blocks=blocks, max_num_seqs=max_b,
        max_model_len=max_ctx + args.steps + 64, max_num_batched_tokens=args.max_batched_tokens or max_ctx,
        cuda_graph_batch_sizes=tuple(sorted({b for b, _ in dec})),
    )
    pool_bytes = llm.engine.kv.k.numel() * llm.engine.kv.k.element_size() * 2
    print(f"model {args.model}: {sum(p.numel() for p in llm.engine.model.parameters()) / 1e9:.2f}B params, "
          f"KV pool {pool_bytes / 1e9:.1f} GB, graphs for {llm.engine.graph_batch_sizes}", flush=True)
    for layer in range(llm.engine.kv.num_layers):  # real-looking KV: never time on zeros
        llm.engine.kv.k[layer].normal_()
        llm.engine.kv.v[layer].normal_()

    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                     "copy_bandwidth": bw, "matmul_flops": flops, "decode": [], "prefill": []}
    from sparsetune.models.artifacts import synthetic_calibration, write_calibration
    from sparsetune.flow.params import parse_param_args
    from sparsetune.loader import get_flow_class

    flows = args.flows.split(",")
    if args.graph_twins:
        flows = [x for f in flows for x in ([f] if f == "dense" else [f, graph_twin(f)])]
    for flow in flows:
        params = {} if flow == "dense" else parse_param_args(args.param)
        if flow != "dense" and get_flow_class(flow).calibrated and "calibration" not in params:
            # Random weights have no meaningful channel ranking, and speed does not depend on
            # which channels are picked: a seeded random order stands in.
            cfg = llm.model_config
            order = synthetic_calibration(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
            path = Path(tempfile.gettempdir()) / f"sparsetune-synthetic-calibration-{args.model}.json"
            params["calibration"] = str(write_calibration(path, args.model, order, None, 0, "synthetic (benchmark)"))
        if flow != "dense" or llm.flow is not None:
            llm.apply(llm.setup.with_flow(flow, params))
        if llm.flow is not None:
            _prefill_fields(llm, dec)
        for variant in variants:
            if set_variant(variant):
                llm.engine.capture_graphs()
            for b, c in dec:
                r = decode_case(llm, b, c, args.steps)
                r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / bw * 1e3
                r["fraction_of_floor"] = r["floor_ms"] / r["step_ms"]
                r["params"] = llm.flow.params() if llm.flow else {}
                r["variant"] = variant
                results["decode"].append(r)
                print(f"decode {flow} {b}x{c} ({variant}): {r['step_ms']:.2f} ms/step (graph {r['graph_replay_ms']:.2f} "
                      f"ms), floor {r['floor_ms']:.2f} ms -> {100 * r['fraction_of_floor']:.1f}% of floor speed", flush=True)
        if args.profile:
            set_variant(variants[0])  # the eager step runs under the first
            # Real prefill of random prompts, then one eager decode step (sparsetune.perf.step_profile).
            b, c = parse_cases(args.profile)[0]
            full = profile_decode(llm, b, c)
            prof = {"case": args.profile, "flow": flow, "ms_by_category": by_category(full), "profile": full}
            results.setdefault("decode_profiles", []).append(prof)
            print(f"eager decode step ({flow}, {args.profile}) kernel time (ms):", prof["ms_by_category"], flush=True)
    dense_rows = {(r["batch"], r["context"], r["variant"]): r for r in results["decode"] if r["flow"] == "dense"}
    for r in results["decode"]:
        d = dense_rows.get((r["batch"], r["context"], r["variant"]))
        if d and r["flow"] != "dense":
            r["speedup_vs_dense"] = d["step_ms"] / r["step_ms"]
            r["floor_speedup"] = d["floor_ms"] / r["floor_ms"]
            print(f"{r['flow']} {r['batch']}x{r['context']} ({r['variant']}): {r['speedup_vs_dense']:.2f}x over dense "
                  f"(floor ratio {r['floor_speedup']:.2f}x -> {100 * r['speedup_vs_dense'] / r['floor_speedup']:.0f}% of it)")

    if args.profile_prefill:
        n = args.profile_prefill
        results["prefill_profile"] = {"tokens": n, "ms_by_category": profile_prefill(llm, n)}
        print(f"prefill of {n} tokens, kernel time (ms):", results["prefill_profile"]["ms_by_category"], flush=True)

    vocab = llm.model_config.vocab_size
    if pre:
        warm = [torch.randint(0, vocab, (pre[0][1],)).tolist()]
        llm.generate(warm, SamplingParams(max_tokens=1), chat=False)
    for b, n in pre:
        prompts = [torch.randint(0, vocab, (n,)).tolist() for _ in range(b)]
        times = {}
        for every_row in (True, False, True, False):  # both ways in one process, interleaved; the best of two
            llm.engine.runner.skip_unused_rows = not every_row
            t = time_call(lambda: llm.generate(prompts, SamplingParams(max_tokens=1), chat=False), llm.device)
            times[every_row] = min(t, times.get(every_row, t))
        llm.engine.runner.skip_unused_rows = True
        t = times[False]
        fl = prefill_flops(llm, n) * b
        r = {"batch": b, "prompt_tokens": n, "seconds": t, "tokens_per_second": b * n / t,
             "flops": fl, "floor_seconds": fl / flops, "achieved_tflops": fl / t / 1e12,
             "flops_done": prefill_flops(llm, n, every_row=False) * b,
             "seconds_every_row": times[True], "tokens_per_second_every_row": b * n / times[True]}
        r["fraction_of_floor"] = r["floor_seconds"] / t
        r["fraction_of_floor_done"] = r["flops_done"] / flops / t
        results["prefill"].append(r)
        print(f"prefill {b}x{n}: {t:.3f} s, {r['tokens_per_second']:.0f} tok/s, {r['achieved_tflops']:.0f} TFLOP/s "
              f"({100 * r['fraction_of_floor']:.1f}% of the FLOP floor; {100 * r['fraction_of_floor_done']:.1f}% of the "
              f"floor of the FLOPs done); every row through the last layer: {times[True]:.3f} s, "
              f"{r['tokens_per_second_every_row']:.0f} tok/s", flush=True)

    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
