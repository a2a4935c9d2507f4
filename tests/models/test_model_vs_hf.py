"""Engine logits and greedy generations equal HF transformers' for the same weights."""

from __future__ import annotations

import pytest
import torch

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams
from helpers import hf_logits, assert_logits_match, tiny_hf

PROMPTS = [
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
    "Write a short poem about a cat sleeping in the sun.",
]


def test_smollm2_logits_match_hf(smollm, smollm_hf):
    for text in PROMPTS[:2]:
        ids = smollm.encode_prompt(text)
        assert_logits_match(smollm.engine.prompt_logits(ids), hf_logits(smollm_hf, ids))


def test_smollm2_greedy_generation_matches_hf(smollm, smollm_hf):
    ids = smollm.encode_prompt(PROMPTS[3])
    [out] = smollm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))
    with torch.no_grad():
        ref = smollm_hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("qwen3", {"head_dim": 32}),
        ("qwen2", {}),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
             "rope_theta": 500000.0},
        ),
    ],
)
def test_tiny_random_models_match_hf(kind, extra, tmp_path):
    hf = tiny_hf(kind, tmp_path, **extra)
    llm = LLM(model=str(tmp_path), device="cpu", max_num_batched_tokens=48, num_kv_blocks=64)
    ids = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    # 150 tokens with a 48-token budget: the prompt is prefilled in 4 chunks through the paged pool.
    assert_logits_match(llm.engine.prompt_logits(ids), hf_logits(hf, ids))
    [out] = llm.generate([ids[:40]], SamplingParams(max_tokens=16, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids[:40]]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.token_ids == ref[0, 40:].tolist()
