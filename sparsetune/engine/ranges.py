"""Named stage ranges for `sparsetune profile`: off (a shared no-op) unless a profile is running.

The engine marks its stages with `with stage("norm"): ...`. While `ENABLED` is False (always,
outside `sparsetune.perf.step_profile`), `stage` returns one shared `nullcontext`: no profiler call, nothing
recorded, nothing inside a CUDA graph. The step profiler switches it on around eager steps
only; then each range is a `torch.profiler.record_function` named `sparsetune::<stage>`, and
every op (CPU time) or kernel (GPU time) is attributed to its innermost stage range.
Ranges are never opened while a CUDA stream is capturing, and never inside torch.compile'd
functions (call sites only), so toggling the flag cannot trigger a recompile.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

PREFIX = "sparsetune::"
ENABLED = False
_OFF = contextlib.nullcontext()


def stage(name: str) -> contextlib.AbstractContextManager:
    """A profiler range `sparsetune::<name>` while profiling; a no-op otherwise."""
    if not ENABLED or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return _OFF
    return torch.profiler.record_function(PREFIX + name)


@contextlib.contextmanager
def stage_ranges() -> Iterator[None]:
    """Turn the stage ranges on for the duration of the block."""
    global ENABLED
    prev, ENABLED = ENABLED, True
    try:
        yield
    finally:
        ENABLED = prev
