"""The one timing harness: seconds per call of a callable (an engine step, a kernel, a graph replay).

By default each call is timed on the host clock (`time.perf_counter`) with the device synchronised
before and after (CUDA; nothing to wait for on CPU), so the GPU work the call queued counts. With
`events=True` (CUDA only) each call is timed between two CUDA events recorded around it on the
current stream instead: GPU time without host overhead, the way to time a CUDA-graph replay.
`percentile` summarises samples (with `statistics.median`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch


def sync(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a CUDA device; a no-op on others)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds of one call of `fn`, host wall time with `device` synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _event_seconds(fn: Callable[[], Any]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_calls(
    fn: Callable[[], Any], device: torch.device | str, repeats: int, warmup: int = 0, events: bool = False,
) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls: `time_call` each,
    or with `events` the CUDA-event time of each on the current stream (GPU time only)."""
    for _ in range(warmup):
        fn()
    if not events:
        return [time_call(fn, device) for _ in range(repeats)]
    sync(device)
    return [_event_seconds(fn) for _ in range(repeats)]


def percentile(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` by nearest rank: an observed value, never interpolated."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
