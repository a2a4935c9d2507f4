"""Programmatic dependent launch (Hopper+) inside a CUDA graph: what it saves per kernel boundary.

    python benchmarks/bench_pdl.py

A chain of 32 dependent element-wise Triton kernels (each adds 1 to the previous one's output)
captured in one graph, launched plainly and with `launch_pdl=True` (each kernel waits with
`gdc_wait` before reading, then lets the next one launch); the result is checked. BENCHMARKS.md, #17.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _add_one(x_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


def _chain(bufs: list[torch.Tensor], n: int, pdl: bool) -> None:
    for a, b in zip(bufs, bufs[1:]):
        _add_one[(triton.cdiv(n, 1024),)](a, b, n, PDL=pdl, BLOCK=1024, launch_pdl=pdl, num_warps=4)


def main(kernels: int = 32) -> None:
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}")
    for n in (16 * 4096, 4 * 1024 * 1024):
        for pdl in (False, True):
            bufs = [torch.zeros(n, device="cuda") for _ in range(kernels + 1)]
            _chain(bufs, n, pdl)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                _chain(bufs, n, pdl)
            bufs[0].fill_(1.0)
            g.replay()
            torch.cuda.synchronize()
            ok = bool(torch.all(bufs[-1] == kernels + 1))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                g.replay()
            start.record()
            for _ in range(100):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / 100 / kernels * 1000
            print(f"{n} elements, PDL {pdl}: {us:.2f} us per kernel in a graph of {kernels}, result correct: {ok}")


if __name__ == "__main__":
    main()
