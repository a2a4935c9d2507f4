"""Helpers shared by the GPU benchmarks: measured ceilings and kernel timing (on `sparsetune.perf.timing`)."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
import triton

from sparsetune.perf.timing import sync, time_calls


def measure_copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling)."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    return 2 * n * 2 / statistics.median(time_calls(lambda: b.copy_(a), "cuda", iters, warmup=3, events=True))


def measure_matmul_flops(n: int = 8192, iters: int = 10) -> float:
    """bf16 GEMM rate on random data (the compute ceiling)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / statistics.median(time_calls(lambda: a @ b, "cuda", iters, warmup=3, events=True))


def bench_us(fn: Callable[[], Any], use_graph: bool = True, rep_ms: int = 60) -> float:
    """Median GPU time of fn in microseconds (CUDA graph replay when possible,
    which is how the engine runs decode and removes host launch overhead)."""
    # do_bench_cudagraph runs fn (eager warm-up, then capture and replay) on a
    # fresh side stream with no dependency on the default stream, where the
    # inputs were just initialised (normal_, randperm, int32 casts): without this
    # barrier the first call can read a block table that is not written yet.
    sync("cuda")
    try:
        if use_graph:
            try:
                return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - fall back, but say so
                print(f"  (cuda graph timing failed: {type(exc).__name__}: {exc}; using do_bench)")
                sync("cuda")
        return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    finally:
        # The graph and its side stream are gone once do_bench_cudagraph returns;
        # make sure their work is finished too before the caller frees inputs.
        sync("cuda")


def rotating(calls: list[Callable[[], Any]]) -> Callable[[], None]:
    """A callable that runs the next of `calls` each time (so a captured graph cycles through them:
    inputs rotated over copies, so that no call finds the last one's bytes in L2)."""
    state = {"i": 0}

    def fn() -> None:
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return fn


def sparse_decode_inputs(batch: int, q_heads: int, kv_heads: int, head_dim: int, page: int, selected: int, unit: int,
                         context: int, rotate: int, gen: torch.Generator, spare_blocks: int) -> tuple:
    """Random bf16 inputs of a sparse paged decode call at full `context` per sequence: (q, k, v, block
    table, seq lens, `rotate` selections of `selected` units of `unit` tokens per (sequence, KV head),
    counts). The sequences' pages lie scattered over a pool with `spare_blocks` more."""
    max_blocks = context // page
    num_blocks = batch * max_blocks + spare_blocks
    k = torch.empty((num_blocks, kv_heads, page, head_dim), dtype=torch.bfloat16, device="cuda").normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    bt = torch.randperm(num_blocks, device="cuda", generator=gen)[: batch * max_blocks].view(batch, max_blocks)
    bt = bt.to(torch.int32).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.empty((batch, q_heads, head_dim), dtype=torch.bfloat16, device="cuda").normal_(generator=gen)
    sels = [torch.rand((batch, kv_heads, context // unit), device="cuda", generator=gen).argsort(-1)[..., :selected]
            .to(torch.int32).contiguous() for _ in range(rotate)]
    counts = torch.full((batch, kv_heads), selected, dtype=torch.int32, device="cuda")
    return q, k, v, bt, lens, sels, counts
