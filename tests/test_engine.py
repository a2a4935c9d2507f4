"""Paging, batching, chunking and preemption never change what the model computes."""

from __future__ import annotations

import random

import torch
from conftest import assert_logits_match, hf_logits

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams

TEXTS = [
    "Name a fruit that is yellow.",
    "What is two plus three? Answer with a number and explain your reasoning step by step in detail.",
    "Hello!",
    "Translate 'good morning' into French, then into Spanish, then into German, and say which is shortest.",
]


def _shuffle_free_blocks(llm: LLM, seed: int = 0) -> None:
    free = list(llm.block_manager.free)
    random.Random(seed).shuffle(free)
    llm.block_manager.free.clear()
    llm.block_manager.free.extend(free)


def test_shuffled_blocks_and_chunked_prefill_match_hf(smollm_hf):
    llm = LLM(model="smollm2-135m", device="cpu", max_num_batched_tokens=32, num_kv_blocks=256, block_size=8)
    _shuffle_free_blocks(llm)
    ids = llm.encode_prompt(TEXTS[3] + " " + TEXTS[1])
    # Prefill in 32-token chunks over non-contiguous 8-token blocks; later chunks read the pool.
    assert len(ids) > 64
    assert_logits_match(llm.prompt_logits(ids), hf_logits(smollm_hf, ids))


def test_batch_equals_one_by_one(smollm):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batched = smollm.generate(TEXTS, params)
    single = [smollm.generate([t], params)[0] for t in TEXTS]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
    assert len({len(b.prompt_token_ids) for b in batched}) == len(TEXTS)  # really mixed lengths


def test_preemption_under_tiny_pool_keeps_outputs(smollm):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in smollm.generate(TEXTS, params)]
    # 4 sequences of ~40-60 tokens growing by 40 need ~24 blocks of 16; give them 12.
    small = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=12, max_num_seqs=8)
    outs = small.generate(TEXTS, params)
    assert small.stats.preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_decode_kernel_path_matches_reference_path():
    """Greedy decode through the Triton kernel (interpreted on CPU) equals the torch path."""
    from sparsetune.engine.attention import DenseAttention

    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = llm.generate([TEXTS[0]], params)[0].token_ids
    llm.set_attention(DenseAttention(llm.model_config.head_dim ** -0.5, use_triton=True))
    assert llm.generate([TEXTS[0]], params)[0].token_ids == ref


def test_layer_hooks_run_and_change_only_what_they_touch(smollm):
    from sparsetune.engine.attention import LayerHooks

    ids = smollm.encode_prompt(TEXTS[0])
    base = smollm.prompt_logits(ids)
    seen: list[tuple[str, int]] = []

    class Recorder(LayerHooks):
        def attention(self, idx, run, hidden, ctx):
            seen.append(("attn", idx))
            return run(hidden)

        def mlp(self, idx, run, hidden, ctx):
            seen.append(("mlp", idx))
            out = run(hidden)
            if idx == 29:  # skip the last layer's MLP for all but the final token
                out = out.clone()
                out[:-1] = 0
            return out

    original = smollm.hooks
    smollm.set_hooks(Recorder())
    try:
        hooked = smollm.prompt_logits(ids)
    finally:
        smollm.set_hooks(original)
    assert ("attn", 0) in seen and ("mlp", 29) in seen
    assert torch.equal(hooked[-1], base[-1])  # causal: the untouched last row is unchanged
    assert not torch.allclose(hooked[:-1], base[:-1])


def test_sampling_top_p_and_seed():
    from sparsetune.engine.sampler import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    temps, top_p = torch.tensor([1.0]), torch.tensor([0.7])
    draws = {sample(logits, temps, top_p, torch.Generator().manual_seed(s)).item() for s in range(200)}
    # Nucleus 0.7 keeps the smallest prefix reaching 0.7: tokens 0 and 1 only.
    assert draws == {0, 1}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = torch.tensor([1.0])
    a = [sample(logits, temps, full, g1).item() for _ in range(50)]
    b = [sample(logits, temps, full, g2).item() for _ in range(50)]
    assert a == b and len(set(a)) > 2
    assert sample(logits, torch.tensor([0.0]), full).item() == 0
