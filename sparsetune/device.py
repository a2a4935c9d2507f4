"""Device and dtype selection. The name checks import no torch, so arguments fail fast."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sparsetune.errors import SparsetuneError

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(name: str | None) -> None:
    """`auto`, `cpu`, `cuda` or `cuda:N` (whether a GPU is there is known once torch loads)."""
    if name is not None and not _DEVICE.match(name):
        raise SparsetuneError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def check_dtype_name(name: str | None) -> None:
    if name is not None and name != "auto" and name not in _DTYPE_NAMES:
        raise SparsetuneError(f"unknown dtype {name!r}; use one of auto, float32, float16, bfloat16")


def resolve_device(name: str | None) -> torch.device:
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(name)
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparsetuneError(f"--device {name} was given but no CUDA GPU is visible; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise SparsetuneError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return dev


def resolve_dtype(name: str | None, device: torch.device, gpu_default: str = "bfloat16") -> torch.dtype:
    import torch

    if name is None or name == "auto":
        return torch.float32 if device.type == "cpu" else getattr(torch, gpu_default)
    check_dtype_name(name)
    return getattr(torch, _DTYPE_NAMES[name])


def release_memory() -> None:
    """Give the device back the memory of what was just let go: reference cycles collected first
    (captured graphs and compiled stages can sit in them with a KV pool), then torch's cached
    blocks, so the memory free on the device says what there is."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
