"""Paging, batching, chunking and preemption never change what the model computes; a forward over a
subset of rows (`engine/rows.py`) computes what HF transformers does with the same edits."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from sparsetune.engine.rows import Rows
from sparsetune.engine.scheduler import Batch
from sparsetune.engine.sequence import SamplingParams, Sequence
from sparsetune.llm import LLM
from helpers import hf_logits, assert_logits_match

TEXTS = [
    "Name a fruit that is yellow.",
    "What is two plus three? Answer with a number and explain your reasoning step by step in detail.",
    "Hello!",
    "Translate 'good morning' into French, then into Spanish, then into German, and say which is shortest.",
]


def _shuffle_free_blocks(llm: LLM, seed: int = 0) -> None:
    free = list(llm.engine.block_manager.free)
    random.Random(seed).shuffle(free)
    llm.engine.block_manager.free.clear()
    llm.engine.block_manager.free.extend(free)


def test_shuffled_blocks_and_chunked_prefill_match_hf(smollm_hf):
    llm = LLM(model="smollm2-135m", device="cpu", max_num_batched_tokens=32, num_kv_blocks=256, block_size=8)
    _shuffle_free_blocks(llm)
    ids = llm.encode_prompt(TEXTS[3] + " " + TEXTS[1])
    # Prefill in 32-token chunks over non-contiguous 8-token blocks; later chunks read the pool.
    assert len(ids) > 64
    assert_logits_match(llm.engine.prompt_logits(ids), hf_logits(smollm_hf, ids))


def test_prefill_runs_the_last_layer_on_the_logit_rows_only_like_hf(smollm_hf):
    """A prefill's last layer attends and runs its MLP on each sequence's last token only, in a batch
    of mixed lengths prefilled in two chunks (the second reads the first's KV from the pool); the
    logits equal HF's at those positions, and those of the same step run over every row."""
    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=256, block_size=8)
    _shuffle_free_blocks(llm)
    prompts = [llm.encode_prompt(t) for t in TEXTS]
    seqs = [Sequence(list(ids), SamplingParams(max_tokens=1)) for ids in prompts]
    mlp_rows = []
    hook = llm.engine.model.model.layers[-1].mlp.register_forward_hook(lambda m, a, out: mlp_rows.append(a[0].shape[0]))
    try:
        for part in (0, 1):
            ns = [len(ids) // 2 if part == 0 else len(ids) - len(ids) // 2 for ids in prompts]
            for seq, n in zip(seqs, ns):
                llm.engine.block_manager.grow(seq, seq.num_computed + n)
            llm.engine.runner.skip_unused_rows = False
            every = llm.engine.runner.run(Batch(True, seqs, ns))  # rewrites the same KV as the next call
            llm.engine.runner.skip_unused_rows = True
            mlp_rows.clear()
            logits = llm.engine.runner.run(Batch(True, seqs, ns))
            assert mlp_rows == [len(seqs)]
            for i, (seq, n) in enumerate(zip(seqs, ns)):
                seq.num_computed += n
                assert_logits_match(logits[i : i + 1], hf_logits(smollm_hf, prompts[i])[seq.num_computed - 1 : seq.num_computed])
            torch.testing.assert_close(logits, every, atol=2e-3, rtol=1e-4)
    finally:
        hook.remove()
        for seq in seqs:
            llm.engine.block_manager.release(seq)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_batch_equals_one_by_one(smollm):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    batched = smollm.generate(TEXTS, params)
    single = [smollm.generate([t], params)[0] for t in TEXTS]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
    assert len({len(b.prompt_token_ids) for b in batched}) == len(TEXTS)  # really mixed lengths


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_preemption_under_tiny_pool_keeps_outputs(smollm):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in smollm.generate(TEXTS, params)]
    # 4 sequences of ~40-60 tokens growing by 40 need ~24 blocks of 16; give them 12.
    small = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=12, max_num_seqs=8)
    outs = small.generate(TEXTS, params)
    assert small.stats.preemptions > 0
    assert [o.token_ids for o in outs] == reference


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_decode_kernel_path_matches_reference_path():
    """Greedy decode through the Triton kernel (interpreted on CPU) equals the torch path."""
    from sparsetune.engine.attention import DenseAttention

    llm = LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = llm.generate([TEXTS[0]], params)[0].token_ids
    llm.set_attention(DenseAttention(llm.model_config.head_dim ** -0.5, use_triton=True))
    assert llm.generate([TEXTS[0]], params)[0].token_ids == ref


class _MaskRows(Rows):
    """A row forward given as masks over the prompt's T tokens per layer: `computed` `[L, T]` (the rows
    whose K/V layer l stores, each layer's a subset of the one before; a row missing from layer l + 1
    stops after layer l's store), `keep` `[L, T, Hkv]` (pairs that keep the pool's KV), `mlp` `[L, T]`."""

    def __init__(self, kv, table, scale, computed, keep, mlp):
        self.computed, self.keep, self.mlp_mask = computed, keep, mlp
        super().__init__(kv, table, computed.shape[1], computed[0].nonzero().squeeze(1), scale)

    def continuing(self, layer, q, k, v):
        nxt = self.computed[min(layer + 1, len(self.computed) - 1)][self.positions]
        return None if bool(nxt.all()) else nxt.nonzero().squeeze(1)

    def keep_cached(self, layer):
        return self.keep[layer][self.positions]

    def mlp_rows(self, layer):
        return self.mlp_mask[layer][self.positions]


def _hf_rows_reference(hf, ids, kc, vc, computed, keep, mlp):
    """Logits `[T, V]` from HF transformers' modules and eager attention, every row through every layer,
    with what `_MaskRows` changes written out: at layer l the K/V of a token not in `computed[l]`, or of
    a pair in `keep[l]`, are the pool's `kc[l]`, `vc[l]` `[Hkv, T, D]`; rows outside `mlp[l]` add no MLP output.
    (A row that is not computed only lends its cached K/V, so its own values here do not matter.)"""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    m, t = hf.model, len(ids)
    h = m.embed_tokens(torch.tensor([ids]))
    cos, sin = m.rotary_emb(h, torch.arange(t)[None])
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    for li, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        heads = lambda proj: proj(x).view(1, t, -1, a.head_dim).transpose(1, 2)  # noqa: E731
        q, k = apply_rotary_pos_emb(heads(a.q_proj), heads(a.k_proj), cos, sin)
        old = (~computed[li][:, None] | keep[li]).T[None, :, :, None]  # [1, Hkv, T, 1]
        k, v = torch.where(old, kc[li][None], k), torch.where(old, vc[li][None], heads(a.v_proj))
        o, _ = eager_attention_forward(a, q, k, v, causal, scaling=a.scaling)
        h = h + a.o_proj(o.reshape(1, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h)) * mlp[li][None, :, None]
    return hf.lm_head(m.norm(h))[0]


@contextmanager
def _blocks(llm, num_tokens):
    """A block table `[blocks]` for one sequence of `num_tokens`, freed afterwards."""
    blocks = llm.engine.block_manager.allocate(-(-num_tokens // llm.engine.kv.block_size))
    try:
        yield torch.tensor(blocks, dtype=torch.int32)
    finally:
        llm.engine.block_manager.free_blocks(blocks)


@torch.inference_mode()
def _row_logits(llm, ids, rows):
    """Logits of the rows a row forward ends with."""
    return llm.engine.model.compute_logits(llm.engine.model(torch.tensor(ids)[rows.positions], rows=rows))


def test_row_forward_over_every_row_is_the_plain_forward(smollm, smollm_hf):
    ids = smollm.encode_prompt(TEXTS[3] + " " + TEXTS[1])
    t, scale = len(ids), smollm.model_config.head_dim**-0.5
    with _blocks(smollm, t) as table:
        logits = _row_logits(smollm, ids, Rows(smollm.engine.kv, table, t, torch.arange(t), scale))
    torch.testing.assert_close(logits, smollm.engine.prompt_logits(ids), rtol=1e-4, atol=1e-4)
    assert_logits_match(logits, hf_logits(smollm_hf, ids))


def test_row_forward_keeps_cached_kv_narrows_rows_and_skips_mlp_like_hf(smollm, smollm_hf):
    """Scattered rows (one masked call) and a long run (a causal call), pairs that keep another text's KV,
    rows that stop after a layer's store, and MLP rows, against HF's modules with the same edits."""
    llm, cfg = smollm, smollm.model_config
    ids = llm.encode_prompt(" ".join(TEXTS))
    t, nl, scale = len(ids), cfg.num_hidden_layers, cfg.head_dim**-0.5
    pos = torch.arange(t)
    computed = torch.ones(nl, t, dtype=torch.bool)
    computed[:, 3:15:3] = False  # never computed: their KV stays the pool's
    computed[12:, 20:50] &= pos[20:50] % 2 == 0  # odd rows stop after layer 11's store
    keep = torch.zeros(nl, t, cfg.num_key_value_heads, dtype=torch.bool)
    keep[3:9, 20:50, 1] = True
    keep[20:, 30::2, 0] = True
    mlp = torch.ones(nl, t, dtype=torch.bool)
    mlp[25:] = pos % 3 != 0
    with _blocks(llm, t) as table:
        _row_logits(llm, ids[::-1], Rows(llm.engine.kv, table, t, pos, scale))  # the pool's KV: another text's
        with torch.inference_mode():
            kc, vc = (torch.stack(x) for x in zip(*(llm.engine.kv.gather(li, table, t) for li in range(nl))))
        rows = _MaskRows(llm.engine.kv, table, scale, computed, keep, mlp)
        assert len(rows.runs.runs) == 1 and rows.runs.rest is not None  # rows 13.. are one causal run
        logits = _row_logits(llm, ids, rows)
    final = computed[-1].nonzero().squeeze(1)
    assert torch.equal(rows.positions, final)
    with torch.no_grad():
        ref = _hf_rows_reference(smollm_hf, ids, kc, vc, computed, keep, mlp)[final]
    assert_logits_match(logits, ref)
    assert (logits - hf_logits(smollm_hf, ids)[final]).abs().max() > 1e-1  # the edits change the outcome


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


def _drive(interleave: bool, num_blocks: int = 64) -> tuple[list[str], list[int]]:
    """Two short prompts decode while a 100-token prompt arrives (chunks of 32): the steps the
    scheduler picks (P: prefill, D: decode) and the step at which each of the two got a token."""
    from sparsetune.engine.block_manager import BlockManager
    from sparsetune.engine.scheduler import Scheduler
    from sparsetune.engine.sequence import Sequence

    sched = Scheduler(BlockManager(num_blocks, 8), max_num_seqs=8, max_num_batched_tokens=32, interleave=interleave)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    short = [Sequence(list(range(10)), params), Sequence(list(range(12)), params)]
    steps, short_tokens = [], []

    def step():
        batch = sched.schedule()
        steps.append("P" if batch.is_prefill else "D")
        sampled = {s.seq_id: 7 for i, s in enumerate(batch.seqs) if not batch.is_prefill or batch.completes_prefill(i)}
        if not batch.is_prefill and short[0] in batch.seqs:
            short_tokens.append(len(steps) - 1)
        sched.postprocess(batch, sampled, (), 10_000)

    for s in short:
        sched.add(s)
    step()  # both short prompts in one prefill
    step()
    sched.add(Sequence(list(range(100)), params))  # arrives mid-decode: 4 chunks
    for _ in range(10):
        step()
    return steps, short_tokens


def test_interleave_puts_a_decode_step_between_prefill_chunks():
    steps, tokens = _drive(interleave=False)
    assert steps == ["P", "D", "P", "P", "P", "P", "D", "D", "D", "D", "D", "D"]  # the prompt stalls decode 4 steps
    steps, tokens = _drive(interleave=True)
    assert steps == ["P", "D", "P", "D", "P", "D", "P", "D", "P", "D", "D", "D"]
    assert all(b - a <= 2 for a, b in zip(tokens, tokens[1:]))  # a running request waits one chunk at most


def test_interleave_never_preempts_and_lets_a_blocked_sequence_wait():
    """A pool too small for every running sequence's next block: the interleaved decode step takes
    only those with room (no preemption); the regular decode step after it still preempts."""
    from sparsetune.engine.block_manager import BlockManager
    from sparsetune.engine.scheduler import Scheduler
    from sparsetune.engine.sequence import Sequence

    sched = Scheduler(BlockManager(4, 8), max_num_seqs=8, max_num_batched_tokens=64, interleave=True)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a, b, c = Sequence(list(range(8)), params), Sequence(list(range(5)), params), Sequence(list(range(9)), params)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [a, b, c]  # 1 + 1 + 2 blocks: the pool is full
    sched.postprocess(batch, {s.seq_id: 1 for s in batch.seqs}, (), 10_000)  # a: 9 tokens, its next needs a block
    batch = sched.schedule()  # interleaved: a waits, b and c have room
    assert not batch.is_prefill and batch.seqs == [b, c] and sched.num_preemptions == 0
    assert list(sched.running) == [a, b, c]
    sched.postprocess(batch, {s.seq_id: 1 for s in batch.seqs}, (), 10_000)
    batch = sched.schedule()  # a regular decode step: the last admitted gives its blocks to a
    assert batch.seqs == [a, b] and sched.num_preemptions == 1 and list(sched.waiting) == [c]


def test_interleave_takes_the_last_free_block_once():
    """Two sequences cross a block boundary on the same step with one block free: the first takes
    it, the second waits (both had passed a room check against the same free list)."""
    from sparsetune.engine.block_manager import BlockManager
    from sparsetune.engine.scheduler import Scheduler
    from sparsetune.engine.sequence import Sequence

    sched = Scheduler(BlockManager(3, 8), max_num_seqs=8, max_num_batched_tokens=64, interleave=True)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a, b = Sequence(list(range(8)), params), Sequence(list(range(8)), params)
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()
    sched.postprocess(batch, {a.seq_id: 1, b.seq_id: 1}, (), 10_000)  # 9 tokens each: each needs a 2nd block
    batch = sched.schedule()
    assert batch.seqs == [a] and len(a.block_table) == 2 and len(b.block_table) == 1


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_interleave_keeps_outputs(smollm):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = [o.token_ids for o in smollm.generate(TEXTS, params)]
    llm = LLM(model="smollm2-135m", device="cpu", max_num_seqs=8, max_num_batched_tokens=16, schedule="interleave")
    assert [o.token_ids for o in llm.generate(TEXTS, params)] == reference
