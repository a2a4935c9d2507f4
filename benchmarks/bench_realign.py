#!/usr/bin/env python
"""GPU benchmark of the fused RoPE-realignment kernel (sparsetune.kernels.rope_realign).

    python benchmarks/bench_realign.py [--layers 36 --kv-heads 8 --head-dim 128 \
        --tokens 29491 --block-size 16 --dtype bfloat16 --layout paged]

Defaults are Qwen3-8B reusing 90% of a 32K context: one segment of `--tokens` tokens
cached at positions 0.. is moved to positions `--new-pos`.. of a new sequence. The
pool holds a source region and a disjoint destination region; with `--layout paged`
(default) each region is a random permutation of its blocks (a real block table),
with `--layout contiguous` both are runs of consecutive blocks. The destination
starts `--new-pos % block_size` slots into its first block, as a segment placed
mid-sequence does, so source and destination offsets within blocks differ.

Prints a correctness spot check against the torch twin, then one JSON line: bytes
moved (read K and V + write K and V = 4 * L * T * H * D * elem), median kernel time
(CUDA events, after warmup), GB/s, and that rate as a fraction of a plain
`dst.copy_(src)` of the same byte count measured in the same run (the practical
HBM ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Callable

# Interpreted Triton would make the timings meaningless.
if os.environ.pop("TRITON_INTERPRET", None) not in (None, "0"):
    print("bench_realign: ignoring TRITON_INTERPRET (GPU benchmark)")

import torch  # noqa: E402

from sparsetune.engine.rope import inv_frequencies  # noqa: E402
from sparsetune.kernels.rope_realign import realign_kv, realign_kv_ref  # noqa: E402
from sparsetune.perf.timing import time_calls  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=29491, help="reused segment length (90%% of 32K)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--new-pos", type=int, default=3277, help="segment's first position in the new sequence")
    ap.add_argument("--theta", type=float, default=1_000_000.0, help="rope theta (Qwen3: 1e6)")
    ap.add_argument("--layout", default="paged", choices=["paged", "contiguous"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def time_ms(fn: Callable[[], None], warmup: int, iters: int) -> float:
    """Median of per-call CUDA-event times."""
    return 1e3 * statistics.median(time_calls(fn, "cuda", iters, warmup, events=True))


def segment_slots(table: torch.Tensor, start: int, n: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions start..start+n-1 of a sequence with block table `table`."""
    pos = torch.arange(start, start + n, device=table.device)
    return table[pos // block_size] * block_size + pos % block_size


def spot_check(head_dim: int, inv_freq: torch.Tensor, block_size: int) -> float:
    """Max |kernel - torch twin| on a small case with deltas up to +-32K (catches GPU-only
    issues such as inaccurate trig for large angles); fp32 so the twin is a tight reference."""
    g = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(3, 65, 5, block_size, head_dim, device="cuda", generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(64 * block_size, device="cuda", generator=g)
    n = 200
    src, dst = perm[:n], perm[n : 2 * n]
    delta = torch.randint(-32768, 32768, (n,), device="cuda", generator=g)
    k2, v2 = k.clone(), v.clone()
    realign_kv(k, v, src, dst, delta, inv_freq)
    realign_kv_ref(k2, v2, src, dst, delta, inv_freq)
    assert torch.equal(v, v2), "V not copied exactly"
    return (k - k2).abs().max().item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_realign needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    L, H, D, bs, T = args.layers, args.kv_heads, args.head_dim, args.block_size, args.tokens
    inv_freq = inv_frequencies(D, args.theta, None).cuda()
    max_err = spot_check(D, inv_freq, bs)

    # Source region: blocks [0, nb); destination region: blocks [nb, 2 nb + 1) (one more
    # block for the in-block shift); the last block is the pool's null block.
    shift = args.new_pos % bs
    nb_src, nb_dst = -(-T // bs), -(-(T + shift) // bs)
    num_blocks = nb_src + nb_dst
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    src_table = torch.arange(nb_src, device="cuda")
    dst_table = torch.arange(nb_src, num_blocks, device="cuda")
    if args.layout == "paged":
        src_table = src_table[torch.randperm(nb_src, device="cuda", generator=g)]
        dst_table = dst_table[torch.randperm(nb_dst, device="cuda", generator=g)]
    src = segment_slots(src_table, 0, T, bs)
    # The destination table covers the new sequence from its first block containing the segment.
    dst = segment_slots(dst_table, shift, T, bs)
    delta = torch.full((T,), args.new_pos, dtype=torch.int64, device="cuda")

    shape = (L, num_blocks + 1, H, bs, D)
    k_pool = torch.randn(shape, dtype=dtype, device="cuda")
    v_pool = torch.randn(shape, dtype=dtype, device="cuda")
    # Sources and destinations are disjoint, so repeated calls are idempotent.
    kernel_ms = time_ms(lambda: realign_kv(k_pool, v_pool, src, dst, delta, inv_freq), args.warmup, args.iters)

    elem = k_pool.element_size()
    moved = 4 * L * T * H * D * elem
    del k_pool, v_pool
    torch.cuda.empty_cache()
    a = torch.empty(moved // 2 // elem, dtype=dtype, device="cuda").normal_()  # read half; the copy writes the other
    b = torch.empty_like(a)
    copy_ms = time_ms(lambda: b.copy_(a), args.warmup, args.iters)
    gbps, copy_gbps = moved / kernel_ms / 1e6, moved / copy_ms / 1e6
    print(json.dumps({
        "device": torch.cuda.get_device_name(), "layers": L, "kv_heads": H, "head_dim": D, "tokens": T,
        "block_size": bs, "dtype": args.dtype, "layout": args.layout, "bytes_moved": moved,
        "kernel_ms": round(kernel_ms, 4), "gb_per_s": round(gbps, 1), "copy_ms": round(copy_ms, 4),
        "copy_gb_per_s": round(copy_gbps, 1), "fraction_of_copy": round(gbps / copy_gbps, 4),
        "spot_check_max_abs_err_fp32": max_err,
    }))


if __name__ == "__main__":
    main()
