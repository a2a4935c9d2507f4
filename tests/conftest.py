"""Shared fixtures. Kernels run through the Triton interpreter when no GPU is present."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped on a machine without CUDA (one rule for every file)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def published_defaults(request, monkeypatch):
    """Tests run flows with their published defaults (the params they give), not the embedded model's
    tuned ones (`setup.tuned_defaults`) nor a developer's saved ones; tests marked `tuned_defaults` see them."""
    if request.node.get_closest_marker("tuned_defaults") is None:
        monkeypatch.setattr("sparsetune.models.artifacts.read_tuned_defaults", lambda *a, **k: {})


@pytest.fixture(scope="session")
def smollm():
    """The embedded default model on CPU, float32 (loaded once per test session)."""
    from sparsetune.llm import LLM

    return LLM(model="smollm2-135m", device="cpu", max_num_seqs=8)


@pytest.fixture(scope="session")
def smollm_hf(smollm):
    """HF transformers' own implementation with the same (dequantized) weights: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm.resolved.weights_dir), dtype=torch.float32)
    return model.eval()


