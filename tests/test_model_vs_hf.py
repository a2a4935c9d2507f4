"""Engine logits and greedy generations equal HF transformers' for the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_logits_match, hf_logits

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "List three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
    "Write a short poem about a cat sleeping in the sun.",
]


def test_smollm2_logits_match_hf(smollm, smollm_hf):
    for text in PROMPTS[:2]:
        ids = smollm.encode_prompt(text)
        assert_logits_match(smollm.prompt_logits(ids), hf_logits(smollm_hf, ids))


def test_smollm2_greedy_generation_matches_hf(smollm, smollm_hf):
    ids = smollm.encode_prompt(PROMPTS[3])
    [out] = smollm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))
    with torch.no_grad():
        ref = smollm_hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()


def _tiny_hf(kind: str, tmp_path, **extra):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    cfg_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[kind]
    cfg = cfg_cls(**common, **extra)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a dropped one shows up
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(tmp_path))
    return model


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
    hf = _tiny_hf(kind, tmp_path, **extra)
    llm = LLM(model=str(tmp_path), device="cpu", max_num_batched_tokens=48, num_kv_blocks=64)
    ids = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    # 150 tokens with a 48-token budget: the prompt is prefilled in 4 chunks through the paged pool.
    assert_logits_match(llm.prompt_logits(ids), hf_logits(hf, ids))
    [out] = llm.generate([ids[:40]], SamplingParams(max_tokens=16, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids[:40]]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.token_ids == ref[0, 40:].tolist()
