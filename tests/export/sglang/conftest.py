"""Tests that import SGLang itself. They run where SGLang imports: `tests/export/test_sglang.py` runs
them in a child process whose path starts with a site folder holding one supported SGLang (0.5.16 or 0.5.23) and the few
packages its import chain needs (installed with `--no-deps`, so this venv's torch stays). Where
SGLang is not importable (the main test process), this folder is not collected."""

from __future__ import annotations

import importlib
import importlib.util

import torch

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    try:
        importlib.import_module("torchvision")  # one built for this torch registers its operators (the test's env)
        torch.ops.torchvision.nms
    except (ImportError, OSError, AttributeError, RuntimeError):
        # A torchvision built for another torch (the index's CUDA build beside a CPU torch) loads no
        # operators; SGLang imports one image decoder of it, and torchvision registers fakes for
        # these two operators at import: their schemas are enough.
        _lib = torch.library.Library("torchvision", "DEF")
        _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
