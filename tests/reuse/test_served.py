"""Reuse requests served by the scheduler: batched with each other and with plain prompts (each as
when run alone), segment fills scheduled before their requests, stored segments found as prefixes,
and eviction under a small pool that never takes a block a request holds."""

from __future__ import annotations

import pytest
import torch

from sparsetune.engine.sequence import SamplingParams, Status
from sparsetune.llm import LLM
from sparsetune.reuse.parts import encode_parts, parse_parts
from helpers import DOC_A, DOC_B

DOC_C = "The museum opens at nine and closes at five. Tickets cost twelve euros for adults. " * 3
QUESTIONS = ["\n\nWhat is the secret code of the blue door?", "\n\nWhich river flows through Paris?",
             "\n\nWhen does the museum open?"]


def _seg(text: str, ns: str = "kb") -> dict:
    return {"text": text, "reuse": True, "namespace": ns}


def _prompts() -> list[list]:
    """Three prompts over the same documents in different orders (each segment at other positions)."""
    a, b, c = _seg(DOC_A), _seg(DOC_B), _seg(DOC_C)
    return [["Documents:\n", a, "\n", b, QUESTIONS[0]], ["Documents:\n", b, "\n", c, "\n", a, QUESTIONS[1]],
            ["Notes:\n", c, "\n", a, QUESTIONS[2]]]


def _layout(llm, parts):
    return encode_parts(llm.tokenizer, parse_parts(parts), chat=False)


def _prompt_kv(llm, seq) -> torch.Tensor:
    k, v = llm.prompt_kv(seq)
    return torch.stack([k, v])


def _drain(llm) -> None:
    while llm.engine.scheduler.has_work():
        llm.engine.step()


SP = SamplingParams(max_tokens=2, ignore_eos=True, keep_logits=True)


@pytest.mark.parametrize("flow", ["cacheblend", "sparsex", "epic"])
def test_reuse_requests_batched_in_one_forward_match_each_run_alone(smollm, flow):
    """Several reuse requests (a selection-layer flow's and a static one's) run in one prefill step: the
    engine reports them planned together, and each gets the first token, logits and prompt KV it
    gets alone (float32, atol 1e-4)."""
    smollm.use_reuse(flow)
    try:
        layouts = [_layout(smollm, p) for p in _prompts()]
        for layout in layouts:
            smollm.cache_segments(layout)
        alone = []
        for layout in layouts:
            seq, _ = smollm.add_reuse_request(layout, SP)
            smollm.engine.step()
            assert smollm.engine.stats.planned_batches[-1] == 1 and seq.logits
            alone.append((seq.logits[0], _prompt_kv(smollm, seq)))
            _drain(smollm)
        seqs = [smollm.add_reuse_request(layout, SP) for layout in layouts]
        smollm.engine.step()
        assert smollm.engine.stats.planned_batches[-1] == len(layouts)
        batched = [(seq.logits[0], _prompt_kv(smollm, seq)) for seq, _ in seqs]
        _drain(smollm)
    finally:
        smollm.use_reuse(None)
    for (la, kva), (lb, kvb), (_, stats) in zip(alone, batched, seqs):
        assert int(la.argmax()) == int(lb.argmax())
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kvb, kva, rtol=1e-4, atol=1e-4)
    for layout, (_, stats) in zip(layouts, seqs):
        assert stats.segment_hits == len(layout.segments) and stats.segment_misses == 0


def test_a_plain_prompt_and_a_reuse_prompt_share_a_prefill_step(smollm):
    plain = "Name three colors of the rainbow."
    want = smollm.generate([plain], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    smollm.use_reuse("cacheblend")
    try:
        layout = _layout(smollm, _prompts()[0])
        smollm.cache_segments(layout)
        alone, _ = smollm.add_reuse_request(layout, SamplingParams(max_tokens=4, ignore_eos=True))
        _drain(smollm)
        steps = smollm.engine.stats.steps
        seq = smollm.engine.add_request(smollm.encode_prompt(plain), SamplingParams(max_tokens=4, ignore_eos=True))
        reuse, _ = smollm.add_reuse_request(layout, SamplingParams(max_tokens=4, ignore_eos=True))
        smollm.engine.step()
        assert smollm.engine.stats.steps == steps + 1 and smollm.engine.stats.planned_batches[-1] == 1
        assert seq.num_completion_tokens == 1 and reuse.num_completion_tokens == 1  # both prefilled in that step
        _drain(smollm)
    finally:
        smollm.use_reuse(None)
    assert seq.completion_ids == want and reuse.completion_ids == alone.completion_ids


def test_segment_misses_are_filled_by_scheduled_steps_before_their_request(smollm):
    """A request whose segments are not cached queues their fills (cache-building prefills of each
    segment alone at position 0) ahead of itself; it runs in a later step and equals a warm one."""
    smollm.use_reuse("cacheblend")
    try:
        parts = ["Preface.\n", _seg(DOC_A, "cold"), "\n", _seg(DOC_C, "cold"), QUESTIONS[2]]
        layout = _layout(smollm, parts)
        cold, stats = smollm.add_reuse_request(layout, SP)
        smollm.engine.step()  # the two fills
        assert cold.status == Status.WAITING and not cold.logits and smollm.engine.stats.planned_batches[-1] == 0
        smollm.engine.step()
        assert cold.logits and stats.segment_misses == 2 and stats.segment_hits == 0
        cold_logits = cold.logits[0]
        _drain(smollm)
        warm, stats = smollm.add_reuse_request(layout, SP)
        smollm.engine.step()
        assert stats.segment_hits == 2 and stats.segment_misses == 0
        torch.testing.assert_close(warm.logits[0], cold_logits, rtol=1e-4, atol=1e-4)
        _drain(smollm)
    finally:
        smollm.use_reuse(None)


@pytest.fixture(scope="module")
def cached():
    return LLM(model="smollm2-135m", device="cpu", max_num_seqs=4, block_size=8, num_kv_blocks=200, prefix_caching=True)


def test_a_stored_segment_is_a_prefix_hit_for_a_prompt_that_starts_with_it(cached):
    """A segment's fill is a prefill at position 0 salted by its namespace: a later plain prompt that
    starts with the segment's tokens takes its full blocks (the default namespace is the unsalted
    one), and its output equals a fresh prefill's; a segment of another namespace is not found."""
    tok = cached.tokenizer
    question = tok.encode("\n\nWhat is the secret code of the blue door? Answer:")
    ids = tok.encode(DOC_A) + question
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    cached.use_reuse("cacheblend")
    try:
        cached.cache_segments(_layout(cached, ["Intro.\n", _seg(DOC_B, "other"), "\n", _seg(DOC_A, "default"), "?"]))
    finally:
        cached.use_reuse(None)
    hits = cached.engine.block_manager.prefix_hits
    got = cached.generate([ids], sp, chat=False)[0].token_ids
    assert cached.engine.block_manager.prefix_hits - hits == len(tok.encode(DOC_A)) // 8
    other = cached.engine.block_manager.prefix_hits
    cached.generate([tok.encode(DOC_B) + question], sp, chat=False)
    assert cached.engine.block_manager.prefix_hits == other  # stored in namespace "other": salted apart
    cached.engine.block_manager.forget_prefixes()
    assert cached.generate([ids], sp, chat=False)[0].token_ids == got


SYSTEM = "You are a careful assistant. Answer from the documents below, in one short sentence.\n"


@pytest.mark.parametrize("flow", ["cacheblend", "sparsex", "epic"])
@pytest.mark.parametrize("prefix", ["plain text", "a segment"])
def test_a_prompt_hits_a_cached_prefix_then_its_segments(cached, flow, prefix):
    """With prefix caching, a reuse request first takes the cached blocks its prompt starts with (a
    plain prompt's system text, or a stored segment at position 0), then its other segments: its
    prefix is counted, never written (the shared blocks' bytes are unchanged), no segment inside it
    is looked up, and its first token, logits and prompt KV equal those of the same request without
    the prefix hit (float32, atol 1e-4)."""
    first = SYSTEM if prefix == "plain text" else _seg(f"{flow}: {DOC_C}", "default")  # a new segment each time
    parts = [first, _seg(DOC_A), "\n", _seg(DOC_B), QUESTIONS[0]]
    bm, kv = cached.engine.block_manager, cached.engine.kv
    cached.use_reuse(flow)
    try:
        layout = _layout(cached, parts)
        cached.cache_segments(layout)  # "a segment": its fill makes the prefix entry
        head = layout.spans[0].end
        if prefix == "plain text":
            cached.generate([layout.token_ids[:head] + [13]], SamplingParams(max_tokens=1), chat=False)
        bm.prefix_caching = False  # the same request without the prefix hit (the index kept)
        cold, cold_stats = cached.add_reuse_request(layout, SP)
        cached.engine.step()
        want = (cold.logits[0], _prompt_kv(cached, cold))
        _drain(cached)
        bm.prefix_caching = True
        hashed = sorted(bm.block_hash)
        before = kv.k[:, hashed].clone(), kv.v[:, hashed].clone()
        seq, stats = cached.add_reuse_request(layout, SP)
        cached.engine.step()
        got = (seq.logits[0], _prompt_kv(cached, seq))
        shared = seq.block_table[: seq.num_cached_tokens // 8]
        _drain(cached)
    finally:
        cached.use_reuse(None)
    num_cached = head // 8 * 8
    assert cold_stats.prefix_tokens == 0 and cold.num_cached_tokens == 0
    assert stats.prefix_tokens == seq.num_cached_tokens == num_cached > 0
    at = [hashed.index(b) for b in shared]  # the shared blocks' bytes, as before the step
    assert torch.equal(kv.k[:, shared], before[0][:, at]) and torch.equal(kv.v[:, shared], before[1][:, at])
    # DOC_C's last, partial block still comes from its segment: looked up, and its reused tokens counted
    assert stats.segment_hits == (2 if prefix == "plain text" else 3)
    assert stats.reused_tokens == cold_stats.reused_tokens - (0 if prefix == "plain text" else num_cached)
    assert int(got[0].argmax()) == int(want[0].argmax())
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def _holders(llm) -> dict[int, int]:
    """Every block's holders: request block tables and stored segments."""
    eng, count = llm.engine, {}
    for seq in list(eng.scheduler.waiting) + list(eng.scheduler.running):
        if seq.plan is not None and seq.plan.cache_only:
            continue  # a fill writes into its segment's blocks (counted below)
        for b in seq.block_table:
            count[b] = count.get(b, 0) + 1
    for seg in llm.segments._segments.values():
        for b in seg.blocks:
            count[b] = count.get(b, 0) + 1
    return count


@pytest.mark.parametrize("pool", ["small", "one request"])
def test_eviction_under_a_small_pool_never_takes_a_held_block(pool):
    """A pool that cannot hold every request and segment at once ("one request": the blocks of the
    largest request, its output and its segments, no more): segments are evicted and filled again
    while requests run, and requests wait for room rather than fail. After every step, each block's
    reference count equals its holders (a block a request holds is never free or handed to another);
    the replies equal a large pool's, and each request counts each of its segments once."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    docs = [DOC_A, DOC_B, DOC_C, DOC_A[::-1], DOC_B[::-1], DOC_C[::-1]]
    prompts = [["Q:\n", _seg(docs[i]), "\n", _seg(docs[(i + 1) % 6]), QUESTIONS[i % 3]] for i in range(6)]
    big = LLM(model="smollm2-135m", device="cpu", max_num_seqs=4, num_kv_blocks=400, reuse="cacheblend")
    want = [o.token_ids for o in big.generate(prompts, sp, chat=False)]
    layouts = [_layout(big, p) for p in prompts]
    blocks = lambda n: -(-n // big.engine.kv.block_size)  # noqa: E731
    need = max(blocks(x.num_tokens + 6) + sum(blocks(len(s)) for s in x.segments) for x in layouts)
    small = LLM(model="smollm2-135m", device="cpu", max_num_seqs=4, num_kv_blocks=64 if pool == "small" else need,
                reuse="cacheblend")
    seqs = [small.add_reuse_request(x, sp) for x in layouts]
    steps = 0
    while small.engine.scheduler.has_work():
        small.engine.step()
        steps += 1
        bm, held = small.engine.block_manager, _holders(small)
        assert all(bm.refs[b] == n for b, n in held.items())
        assert not set(held) & set(bm.free)
        assert steps < 500
    assert small.segments.evictions > 0
    assert [s.completion_ids for s, _ in seqs] == want
    assert all(st.segment_hits + st.segment_misses == 2 for _, st in seqs)


def test_aborted_requests_take_their_fills_and_unfilled_segments_with_them(smollm):
    """Aborting a request whose segments are still to be filled drops the fills nobody else waits for
    and the segments they would have filled, in either order (the fill first, or the request alone):
    the engine is idle again and the pool whole."""
    smollm.use_reuse("cacheblend")
    try:
        for fill_first in (True, False):
            free, stored = smollm.engine.block_manager.num_free, len(smollm.segments)
            parts = ["Intro.\n", _seg(DOC_B[::-1] + str(fill_first), "orphans"), QUESTIONS[1]]
            seq, _ = smollm.add_reuse_request(_layout(smollm, parts), SP)
            smollm.engine.scheduler._schedule_prefill()  # admission only: its fill is queued, nothing ran
            assert seq.admitted and len(smollm.engine.scheduler.waiting) == 2
            if fill_first:
                smollm.engine.abort(smollm.engine.scheduler.waiting[0])
            smollm.engine.abort(seq)
            assert not smollm.engine.scheduler.has_work()
            assert smollm.engine.block_manager.num_free == free and len(smollm.segments) == stored
    finally:
        smollm.use_reuse(None)


@pytest.mark.gpu
@pytest.mark.parametrize("flow", ["cacheblend", "sparsex"])
def test_gpu_reuse_requests_batched_match_each_run_alone(flow, tmp_path):
    """The same on CUDA, where the plans' rows attend in the Triton row kernels (a tiny Qwen3, float32)."""
    from helpers import tiny_hf
    from sparsetune.reuse.parts import ReuseLayout, Span

    tiny_hf("qwen3", tmp_path, head_dim=64)
    llm = LLM(model=str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=2048, cuda_graph_batch_sizes=(1, 2, 4), reuse=flow)
    g = torch.Generator().manual_seed(0)
    toks = lambda n: torch.randint(0, 320, (n,), generator=g).tolist()  # noqa: E731
    docs, head, q = [toks(n) for n in (70, 90, 50)], toks(7), [toks(9) for _ in range(3)]

    def layout(order, question):
        ids, spans = list(head), [Span(0, len(head), False, "default")]
        for i in order:
            spans.append(Span(len(ids), len(ids) + len(docs[i]), True, "kb"))
            ids += docs[i]
        spans.append(Span(len(ids), len(ids) + len(question), False, "default"))
        return ReuseLayout(ids + question, spans)

    layouts = [layout((0, 1), q[0]), layout((1, 2, 0), q[1]), layout((2, 0), q[2])]
    llm.cache_segments(layouts)
    alone = []
    for x in layouts:
        seq, _ = llm.add_reuse_request(x, SP)
        llm.engine.step()
        alone.append((seq.logits[0], _prompt_kv(llm, seq).cpu()))
        _drain(llm)
    seqs = [llm.add_reuse_request(x, SP)[0] for x in layouts]
    llm.engine.step()
    assert llm.engine.stats.planned_batches[-1] == 3
    for seq, (logits, kv) in zip(seqs, alone):
        assert int(seq.logits[0].argmax()) == int(logits.argmax())
        torch.testing.assert_close(seq.logits[0], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_prompt_kv(llm, seq).cpu(), kv, rtol=1e-4, atol=1e-4)
    _drain(llm)
