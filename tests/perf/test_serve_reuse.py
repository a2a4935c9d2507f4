"""`sparsetune bench serve --reuse`: the reuse workloads as drawn, a reuse run's cells and cache
figures on the embedded model, and bad workload options refused in one line."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers import assert_clean_error, run

from sparsetune.perf.serve import ServeConfig, load_resume, serve_benchmark
from sparsetune.perf.workloads import ReuseWorkload, draw


def _segments(layout):
    return [tuple(layout.token_ids[s.start:s.end]) for s in layout.segments]


def test_rag_prompts_draw_distinct_documents_by_zipf_popularity_then_a_question():
    w = ReuseWorkload("rag", docs=10, per_prompt=3, doc_len=5, question_len=4, zipf=1.0)
    got = draw(w, 400, 1000, seed=3, reply_len=[1] * 400)
    corpus = [_segments(c)[0] for c in got.corpus]
    assert len(corpus) == 10 and all(len(d) == 5 for d in corpus)
    counts = Counter()
    for layout in got.layouts:
        segs = _segments(layout)
        assert len(segs) == 3 and len(set(segs)) == 3 and all(s in corpus for s in segs)
        assert layout.spans[-1].reuse is False and len(layout.spans[-1]) == 4 and layout.num_tokens == 19
        counts.update(corpus.index(s) for s in segs)
    assert counts[0] > counts[4] > counts[9]  # popularity falls with the rank
    again = draw(w, 400, 1000, seed=3, reply_len=[1] * 400)
    assert [x.token_ids for x in again.layouts] == [x.token_ids for x in got.layouts]
    assert not draw(ReuseWorkload("rag", docs=10, per_prompt=3, warm=False), 2, 1000, 0, [1, 1]).corpus


def test_chat_turns_resend_their_history_at_moving_positions():
    w = ReuseWorkload("chat", per_prompt=3, doc_len=6, question_len=5)
    got = draw(w, 6, 1000, seed=0, reply_len=[2, 3, 4, 5, 6, 7])
    assert not got.corpus
    sessions = 2  # six requests of three turns: every session's turn t before any turn t + 1
    for j, layout in enumerate(got.layouts):
        turn, s = j // sessions, j % sessions
        assert len(layout.segments) == turn and all(sp.namespace == f"session-{s}" for sp in layout.segments)
        if turn:  # the last turn as the history re-sends it: its message, then its reply
            before = got.layouts[j - sessions]
            message = before.token_ids[before.spans[-1].start:]
            assert _segments(layout)[-1][:6] == tuple(message) and len(_segments(layout)[-1]) == 6 + [2, 3, 4, 5, 6, 7][j - sessions]
            assert _segments(layout)[:-1] == _segments(before)  # the earlier history, unchanged
    starts = {layout.segments[0].start for layout in got.layouts[2:]}
    assert len(starts) > 1  # the fresh note before the history varies: the history moves


def test_agent_prompts_start_with_a_role_prompt_and_share_tool_outputs():
    w = ReuseWorkload("agent", docs=6, per_prompt=2, doc_len=4, question_len=3, agents=2)
    got = draw(w, 50, 1000, seed=1, reply_len=[1] * 50)
    stored = {_segments(c)[0] for c in got.corpus}
    assert len(got.corpus) == 2 + 6
    roles = {_segments(x)[0] for x in got.layouts}
    assert len(roles) == 2 and roles <= stored
    assert all(x.spans[0].start == 0 and set(_segments(x)) <= stored for x in got.layouts)


@pytest.mark.slow
def test_a_reuse_run_serves_plain_prefix_caching_and_a_reuse_flow_from_the_same_cache(smollm, tmp_path):
    cfg = ServeConfig.of(model="smollm2-135m", device="cpu", reuse=("cacheblend",), workload="rag", docs=6,
                         per_prompt=2, doc_len=48, question_len=8, requests=4, rates=(50.0,), output_len="3",
                         warmup=1, slo={"ttft": 60000.0})
    try:
        res = serve_benchmark(cfg, out=tmp_path, llm=smollm)
    finally:
        smollm.apply(smollm.setup.dense())
        smollm.use_reuse(None)
    assert [c["flow"] for c in res["cells"]] == ["plain", "prefix_caching", "cacheblend"] and res["complete"]
    plain, prefix, blend = (c["cache"] for c in res["cells"])
    assert plain["prefix_hit_rate"] == plain["segment_hit_rate"] == 0 and plain["computed_rate"] == 1.0
    assert prefix["segment_hit_rate"] == 0 and 0 < prefix["prefix_hit_rate"] < 1  # stored documents found as prefixes
    assert blend["prefix_hit_rate"] == 0 and blend["segment_hit_rate"] > 0.8 and blend["segment_misses"] == 0
    assert 0 < blend["recompute_rate"] < 0.5 and blend["blocks"] >= 6 * 3  # the warm corpus: 6 documents of 3 blocks
    assert res["slo_rates"]["max_rate"] == {"plain": 50.0, "prefix_caching": 50.0, "cacheblend": 50.0}
    assert res["slo_rates"]["over"]["plain"]["cacheblend"] == 1.0
    assert res["cells"][2]["setup"]["reuse"]["name"] == "cacheblend"
    assert res["cells"][1]["setup"]["engine"]["prefix_caching"] is True
    (run_dir,) = tmp_path.iterdir()
    lines = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and all(r["output_tokens"] == 3 for r in lines)
    assert all(r["reused_tokens"] == 2 * 48 for r in lines if r["flow"] == "cacheblend")
    assert not smollm.engine.config.prefix_caching
    assert load_resume(run_dir)[0] == cfg  # config.json reads back as the run's config (its workload nested)


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["chat", "agent", "agent, prefix caching"])
def test_chat_and_agent_runs_reuse_what_earlier_turns_and_agents_stored(smollm, tmp_path, workload):
    """With --prefix-caching, the reuse flow's prompts take the stored role prompt's full blocks as a
    prefix (exact KV) and only the rest from segments."""
    caching = workload.endswith("prefix caching")
    cfg = ServeConfig.of(model="smollm2-135m", device="cpu", reuse=("pie",), workload=workload.split(",")[0], docs=4,
                         per_prompt=2, doc_len=24, question_len=6, agents=2, requests=4, rates=(50.0,),
                         output_len="2", warmup=0, prefix_caching=caching)
    try:
        res = serve_benchmark(cfg, out=tmp_path, llm=smollm)
    finally:
        smollm.apply(smollm.setup.dense())
        smollm.use_reuse(None)
    (run_dir,) = tmp_path.iterdir()
    lines = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    pie = sorted((r for r in lines if r["flow"] == "pie"), key=lambda r: r["i"])
    assert len(pie) == 4 and all(r["output_tokens"] == 2 for r in pie)
    cache = res["cells"][-1]["cache"]
    if workload == "chat":  # two sessions of two turns: the second turns re-send the first (message + reply)
        assert [r["reused_tokens"] for r in pie] == [0, 0, 24 + 2, 24 + 2]
        assert [r["filled_tokens"] for r in pie] == [0, 0, 26, 26]  # stored by nobody before: filled first
        assert [r["segment_misses"] for r in pie] == [0, 0, 1, 1] and cache["segment_hit_rate"] == 0
    elif not caching:  # a role prompt and two tool outputs, all stored before the cell
        assert all(r["reused_tokens"] == r["stored_tokens"] == 3 * 24 and r["segment_misses"] == 0 for r in pie)
        assert all(r["prefix_tokens"] == 0 for r in pie) and cache["segment_hit_rate"] > 0.8
    else:  # the role prompt's full block (16 of its 24 tokens) is a prefix hit, the rest comes from segments
        assert res["cells"][-1]["setup"]["engine"]["prefix_caching"] and not res["cells"][0]["setup"]["engine"]["prefix_caching"]
        assert all(r["prefix_tokens"] == 16 and r["reused_tokens"] == 3 * 24 - 16 and r["stored_tokens"] == 3 * 24
                   for r in pie)
        assert cache["prefix_hit_rate"] > 0 and cache["segment_misses"] == 0


def test_cli_refuses_bad_workload_options_in_one_line_leaving_nothing(tmp_path):
    cases = [
        (["--reuse", "cacheblend", "--workload", "forum"], "--workload 'forum': use one of rag, chat, agent"),
        (["--reuse", "cacheblend", "--docs", "0"], "--docs 0: it must be at least 1"),
        (["--reuse", "cacheblend", "--docs", "4", "--per-prompt", "6"], "--per-prompt 6 exceeds --docs 4"),
        (["--reuse", "cacheblend", "--zipf", "-1"], "--zipf -1.0"),
        (["--reuse", "quest"], "--reuse quest: a decode flow"),
        (["--reuse", "cacheblend,cacheblend"], "named twice"),
        (["--reuse", "plain"], "always run"),
        (["--workload", "rag"], "--workload describes a reuse run; add --reuse"),
        (["--reuse", "cacheblend", "--input-len", "512"], "--input-len: a reuse run's prompts come from its workload"),
        (["--reuse", "cacheblend", "--flow", "dense,quest"], "one decode flow at most"),
        (["--reuse", "cacheblend", "--prefill", "disaggregated"], "drop --prefill or --reuse"),
        (["--reuse", "cacheblend", "--reuse-param", "nosuch=1"], "nosuch"),
        (["--reuse", "cacheblend", "--reuse-param", "epic:k=3"], "--reuse-param epic:...: 'epic' is not one of --reuse"),
        (["--reuse", "cacheblend", "--doc-len", "9000"], "positions"),
    ]
    for args, needle in cases:
        small = [] if "--doc-len" in args else ["--doc-len", "256"]  # the default 8 x 4096 exceed the model's positions
        assert_clean_error(run("bench", "serve", "--out", str(tmp_path), *small, *args), needle)
    assert not any(tmp_path.iterdir())
