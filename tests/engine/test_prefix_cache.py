"""Prefix caching: prompts that start with the same full blocks share them (hash-chained), and the
results equal an engine without it."""

from __future__ import annotations

import textwrap

import pytest
import torch

from sparsetune.engine.block_manager import BlockManager
from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams, Sequence
from sparsetune.errors import SparsetuneError

PREFIX = "You are a careful assistant. Read the notes and answer briefly. " * 6


@pytest.fixture(scope="module")
def cached():
    return LLM(model="smollm2-135m", device="cpu", max_num_seqs=4, block_size=8, num_kv_blocks=160, prefix_caching=True)


def test_shared_prefix_is_computed_once_and_outputs_match(cached, smollm):
    prompts = [PREFIX + "What is 2 + 2?", PREFIX + "Name a color.", PREFIX + "What is 2 + 2?"]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in smollm.generate(prompts, sp)]
    got, computed = [], []
    for p in prompts:  # one at a time, so each later prompt finds the earlier ones' blocks
        before = cached.stats.prefill_tokens
        out = cached.generate([p], sp)[0]
        got.append(out.token_ids)
        computed.append((cached.stats.prefill_tokens - before, out.prompt_tokens))
    assert got == want
    (n0, t0), (n1, t1), (n2, t2) = computed
    assert n0 == t0  # nothing cached yet
    shared = (len(cached.tokenizer.chat_prompt(PREFIX)) - 8) // 8 * 8  # full blocks of the common start (at least)
    assert n1 <= t1 - shared and n2 < 8  # the repeated prompt computes at most its last partial block
    assert cached.engine.block_manager.prefix_hits > 0


def test_freed_cached_block_taken_by_another_holder_is_forgotten():
    bm = BlockManager(4, 2, prefix_caching=True)
    s = Sequence(list(range(7)), SamplingParams())
    bm.grow(s, 7)
    s.num_computed = 7
    bm.commit(s)  # blocks 0-2 full: hashed
    assert len(bm.by_hash) == 3
    bm.release(s)
    again = Sequence(list(range(7)), SamplingParams())
    assert bm.match_prefix(again) == 6 and bm.refs[again.block_table[0]] == 1
    bm.release(again)
    bm.allocate(4)  # every block handed out again: their contents will change
    assert not bm.by_hash and bm.match_prefix(Sequence(list(range(7)), SamplingParams())) == 0


def test_prefix_caching_refuses_only_a_decode_flow_with_per_request_state(tmp_path):
    with pytest.raises(SparsetuneError, match="prefix caching cannot be combined with the decode flow 'h2o'.*F.save"):
        LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64, prefix_caching=True, flow="h2o")
    # a two-level flow whose first level keeps state (its page stages save a running total)
    path = tmp_path / "stateful_pages.py"
    path.write_text(textwrap.dedent('''
        from sparsetune.flow import TwoLevelFlow
        from sparsetune.flow import ops as F


        class StatefulPages(TwoLevelFlow):
            name = "stateful_pages"

            def cache_page(self, k, v):
                return {"centroid": F.mean(k, dim=1), "acc": F.fill(F.max(F.max(k, dim=1), dim=2), 0.0)}

            def index_page(self, q, fields):
                score = F.add(fields["acc"], F.max(F.gemm(fields["centroid"], q), dim=2))
                F.save(fields, "acc", score)
                return F.topk(score)

            def cache(self, k, v):
                return {"centroid": F.mean(k, dim=1)}

            def index(self, q, fields):
                return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
    '''))
    with pytest.raises(SparsetuneError, match="decode flow 'stateful_pages'.*F.save"):
        LLM(model="smollm2-135m", device="cpu", num_kv_blocks=64, prefix_caching=True, flow=str(path))


QUEST = {"block_size": "8", "budget": "32", "sink_blocks": "1", "local_blocks": "1"}


def test_a_prefix_hit_with_quest_decodes_exactly_like_a_fresh_prefill(cached):
    """Quest's fields are a function of a block's keys: blocks taken from the prefix cache bring the
    fields their first prefill computed, so decoding from a hit selects what a fresh prefill selects:
    the same tokens and logits at every step as an engine without prefix caching (and not dense's:
    the budget is sparse here)."""
    prompts = [PREFIX + "What is 2 + 2?", PREFIX + "Name a color of the sea."]
    sp = SamplingParams(max_tokens=10, ignore_eos=True, keep_logits=True)
    fresh = LLM(model="smollm2-135m", device="cpu", max_num_seqs=4, block_size=8, num_kv_blocks=160, flow="quest",
                params=QUEST)

    def run(llm):  # one prompt at a time: the second finds the first's blocks
        out = []
        for p in prompts:
            seq = llm.engine.add_request(llm.encode_prompt(p), sp)
            llm.engine.run_to_completion([], [seq])
            out.append(seq)
        return out

    cached.apply(cached.setup.with_flow("quest", QUEST))
    try:
        hits = cached.engine.block_manager.prefix_hits
        got = run(cached)
        assert cached.engine.block_manager.prefix_hits - hits >= len(cached.tokenizer.chat_prompt(PREFIX)) // 8 - 1
        cached.apply(cached.setup.dense())
        dense = run(cached)
    finally:
        cached.apply(cached.setup.dense())
    want = run(fresh)
    for hit, ref, full in zip(got, want, dense):
        assert hit.completion_ids == ref.completion_ids
        for a, b in zip(hit.logits, ref.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert max((a - b).abs().max() for a, b in zip(got[1].logits, dense[1].logits)) > 1e-2


def test_reuse_prefilled_prompts_are_never_prefix_hits(cached):
    doc = {"text": "The blue door code is 4417. " * 6, "reuse": True, "namespace": "kb"}
    parts = ["Notes:\n", doc, "\nWhat is the blue door code?"]
    cached.use_reuse("pie")
    try:
        out = cached.generate([parts], SamplingParams(max_tokens=2, ignore_eos=True), chat=False)[0]
    finally:
        cached.use_reuse(None)
    hits = cached.engine.block_manager.prefix_hits
    cached.generate([out.prompt_token_ids], SamplingParams(max_tokens=1))  # same ids, plain prefill
    assert cached.engine.block_manager.prefix_hits == hits  # the reuse flow's approximate KV was not shared
