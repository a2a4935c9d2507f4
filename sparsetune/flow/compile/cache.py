"""The compile cache: generated kernels by their source, one shared object per kernel."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import TypeVar

from sparsetune.records import cache_root, private_dir

T = TypeVar("T")

_LOADED: dict[str, object] = {}  # source hash -> the imported @triton.jit function
_SHARED: dict[object, object] = {}  # generated kernel -> its one instance


def load_kernel(src: str, fn_name: str) -> object:
    """Triton reads a kernel's source from its file: write it (this process's bytes, every time it
    loads one: no check-then-import of a file that could be swapped) into a per-user 0700 folder
    (`records.private_dir`), and import it."""
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    if key not in _LOADED:
        d = private_dir(cache_root() / "kernels")
        path = d / f"{fn_name}_{key}.py"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        tmp.replace(path)
        name = f"sparsetune_generated_{fn_name}_{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED[key] = getattr(module, fn_name)
    return _LOADED[key]


def shared(kernel: T) -> T:
    """The one instance equal to `kernel` (a generated kernel is a value: its source and launch
    settings), so every flow that generates the same code gets the same object and binary."""
    return _SHARED.setdefault(kernel, kernel)  # type: ignore[return-value]
