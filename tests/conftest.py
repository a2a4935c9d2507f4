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


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, min_cos: float = 0.9999) -> None:
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert cos.min().item() >= min_cos, f"min per-position cosine {cos.min().item():.6f}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree == 1.0, f"argmax agrees at {agree:.3f} of positions"
