"""Offline throughput in Vortex's long-generation setting (issue #43): prompts of `--prompt` tokens,
`--gen` generated tokens each (`ignore_eos`), as many sequences as the KV pool holds, one
`LLM.generate` over all of them; throughput = generated tokens / the generate's wall time (Vortex's
measure: completion tokens over the offline run's end-to-end latency).

    python benchmarks/bench_throughput.py --model qwen3-1.7b --flow dense --json-out t.json
    python benchmarks/bench_throughput.py --model qwen3-1.7b --flow block_topk --param budget=2048

One flow a run (a dense run of 16K steps takes minutes: one device call each). `--profile C`: instead
of the run, the same engine's decode step at C tokens (the run's mean context: prompt + gen / 2),
graph-timed and eager, and one eager step's GPU kernel time by stage (`perf.step_profile`), to
compare with the run's mean step (its gap to the kernels is host work and launch gaps). The batch is the
flow's own: its fields take pool blocks, so it may hold fewer sequences than dense; `--batch`
fixes it (e.g. dense's, to compare step for step). Random weights (decode speed does not depend on
the values). The byte floor beside it: each step's weights, K/V and fields (`perf.cost`) at
its context, at the copy bandwidth measured in the run (or `--bandwidth`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import measure_copy_bandwidth  # noqa: E402


def pool_batch(model: str, flow: str | None, params: dict[str, str], seq_tokens: int) -> tuple[int, int]:
    """(sequences the default pool holds at `seq_tokens` each, its blocks a sequence)."""
    from sparsetune.llm import LLM

    llm = LLM(model=model, random_weights=True, flow=flow, params=params, defaults="published",
              max_num_seqs=1, cuda_graph_batch_sizes=(1,))
    per_seq = -(-seq_tokens // llm.engine.kv.block_size)
    batch = llm.engine.kv.num_blocks // per_seq
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return batch, per_seq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--flow", default="dense", help="dense or a decode flow")
    ap.add_argument("--param", action="append", default=[], help="flow param key=value (repeatable)")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=16384)
    ap.add_argument("--batch", type=int, help="sequences (default: as many as the pool holds)")
    ap.add_argument("--bandwidth", type=float, help="copy bandwidth for the byte floor, B/s (default: measured here)")
    ap.add_argument("--profile", type=int, metavar="CONTEXT", help="profile a step at CONTEXT tokens instead of the run")
    ap.add_argument("--sparse-programs-per-sm", type=int, metavar="N",
                    help="an experiment: the sparse decode kernel's split rule aims for N programs per SM (the "
                         "library's `paged_decode._SPARSE_PROGRAMS_PER_SM`), recorded in the row")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    if a.sparse_programs_per_sm:
        from sparsetune.kernels import paged_decode

        paged_decode._SPARSE_PROGRAMS_PER_SM = a.sparse_programs_per_sm

    from sparsetune.engine.sequence import SamplingParams
    from sparsetune.llm import LLM

    flow = None if a.flow == "dense" else a.flow
    params = dict(p.split("=", 1) for p in a.param)
    seq_tokens = a.prompt + a.gen
    held, per_seq = pool_batch(a.model, flow, params, seq_tokens)
    batch = a.batch or held
    if batch < 1 or batch > held:
        raise SystemExit(f"the pool holds {held} sequences of {seq_tokens} tokens; --batch {batch} does not fit")
    t_build = time.perf_counter()
    llm = LLM(model=a.model, random_weights=True, flow=flow, params=params, defaults="published",
              max_num_seqs=batch, num_kv_blocks=batch * per_seq + 1, cuda_graph_batch_sizes=(batch,),
              max_model_len=seq_tokens + 16)
    g = torch.Generator().manual_seed(0)
    vocab = llm.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt,), generator=g).tolist() for _ in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), chat=False)  # warm-up: compiles, graphs
    build_s = time.perf_counter() - t_build
    if a.profile:
        return profile(a, llm, batch)
    s = llm.engine.stats
    s.prefill_tokens = s.decode_tokens = 0
    s.decode_seconds = 0.0
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.gen, ignore_eos=True), chat=False)
    sync()
    wall = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    row = {
        "model": a.model, "flow": a.flow, "params": params, "resolved": llm.flow.params() if llm.flow else {},
        "gpu": torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu", "prompt": a.prompt, "gen": a.gen, "batch": batch, "pool_holds": held,
        "generated_tokens": generated, "wall_seconds": wall, "throughput_tokens_per_second": generated / wall,
        "decode_seconds": s.decode_seconds, "decode_tokens": s.decode_tokens, "preemptions": s.preemptions,
        "mean_step_ms": 1e3 * s.decode_seconds / max(1, s.decode_tokens / batch), "build_seconds": build_s,
        "date": time.strftime("%Y-%m-%d"), "sparse_programs_per_sm": sparse_programs_per_sm(),
    }
    row["bandwidth"] = a.bandwidth or measure_copy_bandwidth()
    row["floor_tokens_per_second"] = floor_throughput(llm, batch, a.prompt, a.gen, row["bandwidth"])
    print(json.dumps(row), flush=True)
    print(f"{a.model} {a.flow} {params}: batch {batch} (pool holds {held}), {generated} tokens in {wall:.1f} s = "
          f"{row['throughput_tokens_per_second']:.0f} tok/s (byte floor {row['floor_tokens_per_second']:.0f}); "
          f"mean step {row['mean_step_ms']:.2f} ms, {s.preemptions} preemptions", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(row, f, indent=2)


def profile(a, llm, batch: int) -> None:
    from sparsetune.perf.step_profile import profile_decode

    prof = profile_decode(llm, batch, a.profile, steps=5)
    row = {"model": a.model, "flow": a.flow, "params": dict(p.split("=", 1) for p in a.param), "batch": batch,
           "context": a.profile, "gpu": torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu",
           "step_ms": prof.get("step_ms"), "eager_step_ms": prof.get("eager_step_ms"),
           "kernel_ms": {k: v["ms"] for k, v in prof["categories"].items()}, "date": time.strftime("%Y-%m-%d"),
           "sparse_programs_per_sm": sparse_programs_per_sm()}
    row["kernel_total_ms"] = sum(row["kernel_ms"].values())
    print(json.dumps(row), flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({**row, "profile": prof}, f, indent=2, default=str)


def sparse_programs_per_sm() -> int:
    from sparsetune.kernels import paged_decode

    return paged_decode._SPARSE_PROGRAMS_PER_SM


def floor_throughput(llm, batch: int, prompt: int, gen: int, bandwidth: float) -> float:
    """Generated tokens per second if every decode step read only its bytes
    (`perf.cost.decode_step_bytes` at each step's context, summed over the run in 16 pieces) at
    `bandwidth`; prefill not counted."""
    from sparsetune.perf.cost import decode_step_bytes

    pieces = 16
    seconds = 0.0
    for i in range(pieces):
        ctx = prompt + int((i + 0.5) * gen / pieces)
        seconds += gen / pieces * decode_step_bytes(llm.model_config, llm.flow, batch, ctx, llm.dtype.itemsize).total / bandwidth
    return batch * gen / seconds


if __name__ == "__main__":
    main()
