"""Device and dtype selection."""

from __future__ import annotations

import torch

from sparsetune.errors import SparsetuneError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SparsetuneError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SparsetuneError("--device cuda was given but no CUDA GPU is visible; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise SparsetuneError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    return dev


def resolve_dtype(name: str | None, device: torch.device, gpu_default: str = "bfloat16") -> torch.dtype:
    if name is None or name == "auto":
        return torch.float32 if device.type == "cpu" else _DTYPES[gpu_default]
    if name not in _DTYPES:
        raise SparsetuneError(f"unknown dtype {name!r}; use one of float32, float16, bfloat16")
    return _DTYPES[name]
