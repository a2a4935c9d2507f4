"""The engine's request API: abort, per-request events, eager mode, admitting a prefilled request.
Each is checked against plain `generate` on the same engine (the reference for what tokens come out)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sparsetune.engine.sequence import SamplingParams, Status

PROMPTS = ["Name a fruit that is yellow.", "Hello!", "What is two plus three?"]


def _reference(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def _run(llm, seqs):
    while llm.engine.scheduler.has_work():
        llm.engine.step()
    return [s.completion_ids for s in seqs]


def test_engine_imports_no_flow_or_reuse():
    code = ("import sys, sparsetune.engine.engine\n"
            "bad = [m for m in sys.modules if m.startswith(('sparsetune.flow', 'sparsetune.reuse', 'sparsetune.llm',"
            " 'sparsetune.loader', 'sparsetune.evaluation'))]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_abort_waiting_and_running_requests_frees_blocks_and_keeps_the_others(smollm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = _reference(smollm, PROMPTS, params)
    free = smollm.engine.block_manager.num_free
    ids = [smollm.encode_prompt(p) for p in PROMPTS]
    seqs = [smollm.engine.add_request(i, params) for i in ids]
    smollm.engine.step()  # the prefill of all three
    for _ in range(3):
        smollm.engine.step()
    smollm.engine.abort(seqs[1])  # mid-decode
    late = smollm.engine.add_request(ids[1], params)
    smollm.engine.abort(late)  # still waiting
    out = _run(smollm, seqs)
    assert out[0] == ref[0] and out[2] == ref[2]
    assert seqs[1].finish_reason == "abort" and late.finish_reason == "abort"
    assert seqs[1].status == Status.FINISHED and len(seqs[1].completion_ids) == 4
    assert late.events.scheduled is None and late.events.finished is not None
    assert smollm.engine.block_manager.num_free == free
    smollm.engine.abort(seqs[0])  # a finished request is left as it is
    assert seqs[0].finish_reason == "length"


def test_request_events_are_ordered_and_count_every_token(smollm):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seqs = [smollm.engine.add_request(smollm.encode_prompt(p), params, arrival=0.0) for p in PROMPTS]
    _run(smollm, seqs)
    for s in seqs:
        ev = s.events
        assert ev.arrival == 0.0 < ev.scheduled <= ev.first_token <= ev.finished
        assert ev.tokens[0] == ev.first_token and ev.tokens[-1] == ev.finished
        assert len(ev.tokens) == s.num_completion_tokens == 5
        assert ev.tokens == sorted(ev.tokens)


def test_eager_mode_restores_the_switch(smollm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = _reference(smollm, PROMPTS[:1], params)
    assert not smollm.engine.eager
    with smollm.engine.eager_mode():
        assert smollm.engine.eager and not smollm.engine.uses_graphs
        assert _reference(smollm, PROMPTS[:1], params) == ref
    assert not smollm.engine.eager


def _copy_blocks(llm, src: list[int], dst: list[int]) -> None:
    s, d = torch.tensor(src), torch.tensor(dst)
    for layer in range(llm.engine.kv.num_layers):
        llm.engine.kv.k[layer][d] = llm.engine.kv.k[layer][s]
        llm.engine.kv.v[layer][d] = llm.engine.kv.v[layer][s]


@pytest.mark.parametrize("with_logits", [False, True])
def test_admit_prefilled_continues_like_a_normal_request(smollm, with_logits):
    """KV written outside the step loop (here: copied from a request the engine prefilled itself)
    decodes to the same tokens as the request run normally."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ids = smollm.encode_prompt(PROMPTS[0])
    ref = _reference(smollm, [ids], params)[0]
    free = smollm.engine.block_manager.num_free
    donor = smollm.engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True))
    smollm.engine.step()  # prefill: the donor's blocks hold the prompt's KV
    seq = smollm.engine.reserve(ids, params)
    _copy_blocks(smollm, donor.block_table, seq.block_table)
    smollm.engine.abort(donor)
    logits = smollm.engine.prompt_logits(ids)[-1] if with_logits else None
    smollm.engine.admit_prefilled(seq, logits)
    assert seq.status == Status.RUNNING and seq.events.scheduled is not None
    assert _run(smollm, [seq])[0] == ref
    assert smollm.engine.block_manager.num_free == free


def test_token_ids_outside_the_vocabulary_are_refused_and_nothing_is_queued(smollm):
    from sparsetune.errors import SparsetuneError

    vocab = smollm.model_config.vocab_size
    params = SamplingParams(max_tokens=1)
    for bad in ([1, vocab], [-1, 2]):
        for add in (smollm.engine.add_request, smollm.engine.reserve):
            with pytest.raises(SparsetuneError, match=rf"in \[0, {vocab}\)"):
                add(bad, params)
    assert not smollm.engine.scheduler.has_work()
    assert smollm.generate([[1, vocab - 1]], params)[0].token_ids  # the edges of the range are fine


@pytest.fixture
def overlapped(smollm, monkeypatch):
    """A switch that turns overlapped decode steps on for the embedded engine (on CPU too: the same
    code, run in order; off by default there), and the list of launches, True for one ahead."""
    from dataclasses import replace

    def on():
        monkeypatch.setattr(smollm.engine, "config", replace(smollm.engine.config, overlap=True))

    assert not smollm.engine.overlap
    launch, ahead = smollm.engine._launch, []

    def counted(batch, t0, ids_ahead=None):
        ahead.append(ids_ahead is not None)
        return launch(batch, t0, ids_ahead)

    monkeypatch.setattr(smollm.engine, "_launch", counted)
    yield on, ahead
    while smollm.engine.step() or smollm.engine.scheduler.has_work():  # nothing left in flight for the next test
        pass
    smollm.engine.step()


def test_overlapped_steps_keep_tokens_and_finish_reasons(smollm, overlapped):
    """Each greedy decode step launched before the last one's tokens are read, on their device ids:
    the same tokens and finish reasons as step by step, with requests that stop on a token mid-batch
    (their one extra step dropped) and requests of other lengths; the pool ends as it began."""
    free = smollm.engine.block_manager.num_free
    long = [o.token_ids for o in smollm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
    params = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=16, stop_token_ids=(long[1][5],)),
              SamplingParams(max_tokens=16, stop_token_ids=(long[2][10],))]
    ref = smollm.generate(PROMPTS, params)
    assert [o.finish_reason for o in ref] == ["length", "stop", "stop"]
    on, ahead = overlapped
    on()
    engine = smollm.engine
    got = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    assert sum(ahead) >= 8  # most decode steps ran one ahead
    engine.step()  # a step still in flight after the last stop is dropped
    assert engine._inflight is None and engine.block_manager.num_free == free


def test_overlapped_steps_with_an_abort_and_a_late_request(smollm, overlapped):
    """A request aborted while a step is in flight ends with what was read; one added then waits
    for the step to be read and prefills; the others come out as `generate` makes them."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = _reference(smollm, PROMPTS, params)
    on, ahead = overlapped
    on()
    engine = smollm.engine
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    seqs = [engine.add_request(i[:], params) for i in ids[:2]]
    for _ in range(5):
        engine.step()
    assert engine._inflight is not None and any(ahead)
    engine.abort(seqs[1])
    late = engine.add_request(ids[2], params)
    out = _run(smollm, seqs + [late])
    assert out[0] == ref[0] and out[2] == ref[2]
    assert seqs[1].finish_reason == "abort" and out[1] == ref[1][: len(out[1])]


def test_overlap_turned_off_mid_flight_reads_the_step_and_launches_no_other(smollm, overlapped, monkeypatch):
    """Overlap switched off while a step is in flight (eager mode does this where graphs replay):
    the next call reads it and launches nothing ahead; the tokens are those of `generate`."""
    from dataclasses import replace

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = _reference(smollm, PROMPTS[:2], params)
    on, ahead = overlapped
    on()
    seqs = [smollm.engine.add_request(smollm.encode_prompt(p), params) for p in PROMPTS[:2]]
    for _ in range(4):
        smollm.engine.step()
    assert smollm.engine._inflight is not None
    monkeypatch.setattr(smollm.engine, "config", replace(smollm.engine.config, overlap=False))
    launched = len(ahead)
    smollm.engine.step()
    assert smollm.engine._inflight is None and len(ahead) == launched
    assert _run(smollm, seqs) == [r for r in ref]
