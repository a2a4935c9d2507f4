"""Helpers shared by the GPU benchmarks: measured ceilings and timing."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import triton


def measure_copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (the HBM ceiling)."""
    n = int(gib * 2**30) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times)


def measure_matmul_flops(n: int = 8192, iters: int = 10) -> float:
    """bf16 GEMM rate on random data (the compute ceiling)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times)


def wall(fn, sync: bool = True) -> float:
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_us(fn: Callable[[], Any], use_graph: bool = True, rep_ms: int = 60) -> float:
    """Median GPU time of fn in microseconds (CUDA graph replay when possible,
    which is how the engine runs decode and removes host launch overhead)."""
    # do_bench_cudagraph runs fn (eager warm-up, then capture and replay) on a
    # fresh side stream with no dependency on the default stream, where the
    # inputs were just initialised (normal_, randperm, int32 casts): without this
    # barrier the first call can read a block table that is not written yet.
    torch.cuda.synchronize()
    try:
        if use_graph:
            try:
                return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
            except Exception as exc:  # noqa: BLE001 - fall back, but say so
                print(f"  (cuda graph timing failed: {type(exc).__name__}: {exc}; using do_bench)")
                torch.cuda.synchronize()
        return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    finally:
        # The graph and its side stream are gone once do_bench_cudagraph returns;
        # make sure their work is finished too before the caller frees inputs.
        torch.cuda.synchronize()
