"""`sparsetune bench serve`: the workload, the open-loop driver on a virtual clock, the figures from
request records, and runs on the embedded model (engine and disaggregated prefill, resume, CLI)."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from helpers import assert_clean_error, run

from sparsetune.engine.sequence import Sequence, Status
from sparsetune.errors import SparsetuneError
from sparsetune.perf.serve import (Lengths, Request, ServeConfig, arrival_offsets, draw_requests, reductions,
                                   run_requests, serve_benchmark, summarize)

# ---- the workload ---------------------------------------------------------------------------------


def test_length_mixes_parse_and_draw_what_they_say():
    rng = random.Random(0)
    assert {Lengths.parse("512", "--input-len").draw(rng) for _ in range(20)} == {512}
    span = [Lengths.parse("100-104", "--input-len").draw(rng) for _ in range(2000)]
    assert set(span) == {100, 101, 102, 103, 104}
    mix = [Lengths.parse("10:3, 20:1", "--input-len").draw(rng) for _ in range(4000)]
    assert set(mix) == {10, 20} and abs(mix.count(10) / len(mix) - 0.75) < 0.03
    assert Lengths.parse("4096:0.7,16384:0.3", "x").max == 16384
    for bad, needle in (("abc", "write N, A-B"), ("9-3", "low end is above"), ("10:0", "positive"),
                        ("0", "at least 1"), ("1:2:3", "write N, A-B")):
        with pytest.raises(SparsetuneError, match=needle):
            Lengths.parse(bad, "--input-len")


def test_arrivals_are_poisson_and_the_same_requests_at_every_rate():
    fixed = Lengths.parse("8", "x")
    reqs = draw_requests(20000, fixed, fixed, seed=3)
    assert reqs == draw_requests(20000, fixed, fixed, seed=3)
    for rate in (0.5, 8.0):
        offs = arrival_offsets(reqs, rate)
        gaps = [b - a for a, b in zip([0.0] + offs, offs)]
        assert abs(statistics.mean(gaps) * rate - 1) < 0.03  # mean gap 1/rate
        assert abs(statistics.pstdev(gaps) / statistics.mean(gaps) - 1) < 0.03  # exponential: CV 1
    slow, fast = arrival_offsets(reqs[:50], 1.0), arrival_offsets(reqs[:50], 4.0)
    assert fast == pytest.approx([t / 4 for t in slow])  # only the time scale changes


# ---- the open-loop driver on a virtual clock ------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class _SteppedEngine:
    """The request API of an engine whose every step takes `dt` virtual seconds and gives every
    request in it one token (its first, for a request new to the step)."""

    def __init__(self, clock: _Clock, dt: float = 0.1) -> None:
        self.clock, self.dt, self.live = clock, dt, []
        self.scheduler = self.engine = self  # an LLM's `engine` and its scheduler, in one

    def has_work(self) -> bool:
        return bool(self.live)

    def add_request(self, ids, params, arrival):
        seq = Sequence(list(ids), params)
        seq.events.arrival = arrival
        self.live.append(seq)
        return seq

    def step(self):
        start = self.clock.t
        self.clock.t += self.dt
        done = []
        for s in self.live:
            s.events.scheduled = start if s.events.scheduled is None else s.events.scheduled
            s.token_ids.append(0)
            s.events.first_token = s.events.first_token or self.clock.t
            s.events.tokens.append(self.clock.t)
            if s.num_completion_tokens == s.params.max_tokens:
                s.status, s.events.finished = Status.FINISHED, self.clock.t
                done.append(s)
        self.live = [s for s in self.live if s not in done]
        return done

    def abort(self, seq) -> None:
        pass


def test_latencies_count_from_arrival_and_the_loop_sleeps_until_the_next_one():
    clock = _Clock()
    eng = _SteppedEngine(clock)
    reqs = [Request(0, 4, 3), Request(0, 4, 2), Request(0, 4, 2), Request(0, 4, 2)]
    recs = run_requests(eng, reqs, [[1] * 4] * 4, [0.0, 0.25, 0.25, 2.0], clock=clock, sleep=clock.sleep)
    r0, r1, r2, r3 = recs
    # r0: steps [0, .1], [.1, .2], [.2, .3]: its three tokens.
    assert r0["ttft_s"] == pytest.approx(0.1) and r0["e2e_s"] == pytest.approx(0.3)
    assert r0["tpot_s"] == pytest.approx(0.1) and r0["itl_s"] == pytest.approx([0.1, 0.1])
    # r1, r2 arrive at .25, during r0's third step: they wait for it (queue .05) and get their first
    # token at .4; their latencies count from .25, not from when the loop took them in (.3).
    for r in (r1, r2):
        assert r["queue_s"] == pytest.approx(0.05) and r["ttft_s"] == pytest.approx(0.15)
        assert r["e2e_s"] == pytest.approx(0.25) and r["finish_s"] == pytest.approx(0.5)
    # Idle from .5: the loop sleeps until r3 arrives at 2.0, which then runs at once.
    assert r3["arrival_s"] == pytest.approx(2.0) and r3["queue_s"] == pytest.approx(0.0)
    assert r3["ttft_s"] == pytest.approx(0.1) and r3["finish_s"] == pytest.approx(2.2)


# ---- the figures ----------------------------------------------------------------------------------


def _rec(arrival: float, finish: float, ttft: float = 0.1, tpot: float | None = 0.02, n: int = 3) -> dict:
    return {"arrival_s": arrival, "finish_s": finish, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": finish - arrival,
            "queue_s": 0.0, "input_len": 10, "output_tokens": n, "itl_s": [tpot] * (n - 1) if tpot else []}


def test_summary_percentiles_throughput_slo_and_kept_up():
    recs = [_rec(i * 1.0, i * 1.0 + 0.5, ttft=0.1 * (i + 1), tpot=0.01 * (i + 1)) for i in range(10)]
    cell = summarize(recs, 1.0, {"ttft": 450, "tpot": 100})
    assert cell["ttft_ms"]["p50"] == pytest.approx(500)  # nearest rank
    assert cell["ttft_ms"]["p95"] == pytest.approx(1000) and cell["ttft_ms"]["mean"] == pytest.approx(550)
    assert cell["tpot_ms"]["p99"] == pytest.approx(100)
    assert cell["duration_s"] == pytest.approx(9.5) and cell["request_throughput"] == pytest.approx(10 / 9.5, abs=1e-3)
    assert cell["output_tokens"] == 30 and cell["output_throughput"] == pytest.approx(30 / 9.5, abs=0.01)
    assert cell["slo"]["attainment"] == pytest.approx(0.4)  # ttft <= 450 ms: the first four
    assert cell["slo"]["goodput"] == pytest.approx(4 / 9.5, abs=1e-3)
    assert cell["kept_up"] is True and cell["finish_rate"] == pytest.approx(cell["arrival_rate"])
    # A growing backlog: each request finishes 1.5 s after the previous one while they arrive 1 s apart.
    backlog = [_rec(i * 1.0, 1 + 1.5 * i) for i in range(20)]
    assert summarize(backlog, 1.0)["kept_up"] is False and "slo" not in summarize(backlog, 1.0)
    # Arrivals spanning less than two median E2E latencies: too short to tell (all may fit in one batch).
    burst = [_rec(i * 0.1, 5 + i * 0.1) for i in range(10)]
    assert summarize(burst, 10.0)["kept_up"] is None
    # One-token outputs have no TPOT and no gaps; they do not count there.
    single = summarize([_rec(0, 1, tpot=None, n=1), _rec(1, 2, tpot=0.05, n=2)], 1.0)
    assert single["tpot_ms"]["p50"] == pytest.approx(50) and single["itl_ms"]["mean"] == pytest.approx(50)


def test_reductions_are_taken_at_the_highest_rate_dense_kept_up_with():
    def cell(flow, rate, tpot, kept):
        stats = {"mean": tpot, "p50": tpot, "p95": tpot, "p99": tpot}
        return {"flow": flow, "rate": rate, "kept_up": kept, "tpot_ms": stats, "ttft_ms": stats, "e2e_ms": stats}

    cells = [cell("dense", 1, 40, True), cell("dense", 2, 60, True), cell("dense", 4, 300, False),
             cell("quest", 1, 20, True), cell("quest", 2, 20, True), cell("quest", 4, 25, True)]
    red = reductions(cells)
    assert red["dense_max_kept_up_rate"] == 2
    assert red["at"]["max_kept_up_rate"]["flows"]["quest"]["tpot_p95"] == pytest.approx(3.0)
    assert red["at"]["max_rate"]["rate"] == 4 and red["at"]["max_rate"]["flows"]["quest"]["tpot_p95"] == pytest.approx(12.0)


# ---- on the embedded model ------------------------------------------------------------------------


def _config(**kw) -> ServeConfig:
    base = dict(model="smollm2-135m", device="cpu", max_num_seqs=8, flows=("block_topk",), params=("budget=64",),
                rates=(40.0,), requests=4, input_len="16-48", output_len="3:1,5:1", warmup=1, seed=1)
    return ServeConfig.of(**{**base, **kw}).with_dense()


@pytest.mark.slow
def test_engine_prefill_serves_every_request_to_its_length_and_resumes_after_an_interrupt(smollm, tmp_path):
    cfg = _config(rates=(40.0, 400.0))
    seen = []

    def stop_at_second_cell(kind, data):
        if kind == "cell":
            seen.append((data["flow"], data["rate"]))
            if len(seen) == 2:
                raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            serve_benchmark(cfg, out=tmp_path, llm=smollm, on_event=stop_at_second_cell)
        (run_dir,) = tmp_path.iterdir()
        partial = json.loads((run_dir / "results.json").read_text())
        assert not partial["complete"] and [(c["flow"], c["rate"]) for c in partial["cells"]] == [("dense", 40.0)]
        assert not smollm.engine.scheduler.has_work()  # the interrupted cell gave its requests back
        res = serve_benchmark(resume=run_dir, llm=smollm, on_event=lambda k, d: seen.append(k))
    finally:
        smollm.apply(smollm.setup.with_flow(None))
    assert res["complete"] and res["cells"][0] == partial["cells"][0]  # the finished cell was not run again
    assert [(c["flow"], c["rate"]) for c in res["cells"]] == [(f, r) for f in ("dense", "block_topk") for r in (40.0, 400.0)]
    assert res["cells"][2]["params"]["budget"] == 64
    lines = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * 4
    reqs = draw_requests(4, *cfg.lengths(), cfg.seed)
    for rec in lines:
        req = reqs[rec["i"]]
        assert (rec["input_len"], rec["output_len"]) == (req.input_len, req.output_len)
        assert rec["output_tokens"] == req.output_len and rec["finish_reason"] == "length"
        assert 0 <= rec["queue_s"] <= rec["ttft_s"] <= rec["e2e_s"] and len(rec["itl_s"]) == req.output_len - 1
    assert (run_dir / "latency.png").stat().st_size > 0


def test_disaggregated_prefill_admits_a_request_only_when_a_slot_is_free(smollm, tmp_path):
    from sparsetune.llm import LLM

    llm = LLM(model="smollm2-135m", device="cpu", max_num_seqs=1)
    cfg = _config(flows=("dense",), params=(), rates=(1000.0,), requests=3, prefill="disaggregated", warmup=0,
                  max_num_seqs=1)
    res = serve_benchmark(cfg, out=tmp_path, llm=llm)
    recs = sorted((json.loads(x) for x in (next(tmp_path.iterdir()) / "requests.jsonl").read_text().splitlines()),
                  key=lambda r: r["i"])
    assert [r["output_tokens"] for r in recs] == [r.output_len for r in draw_requests(3, *cfg.lengths(), cfg.seed)]
    for prev, nxt in zip(recs, recs[1:]):  # one at a time: admitted once the previous one finished
        assert nxt["arrival_s"] + nxt["queue_s"] >= prev["finish_s"] - 1e-6
    assert res["cells"][0]["queue_ms"]["p95"] > 0


def test_cli_refuses_bad_input_in_one_line_before_loading_anything(tmp_path):
    cases = [
        (["--rate", "0"], "--rate 0.0"),
        (["--rate", "fast"], "comma-separated numbers"),
        (["--input-len", "900-100"], "low end is above"),
        (["--slo", "latency=3"], "targets are ttft, tpot, e2e"),
        (["--slo", "ttft"], "metric=milliseconds"),
        (["--flow", "nosuch_flow"], "nosuch_flow"),
        (["--param", "budget=many"], "budget"),
        (["--param", "quest:nosuch=1"], "--param quest:nosuch: quest has no such param (it has"),
        (["--param", "nosuch=1"], "--param nosuch: block_topk has no such param"),
        (["--prefill", "remote"], "engine, disaggregated"),
        (["--input-len", "9000", "--output-len", "9000"], "positions"),
        (["--requests", "1"], "at least 2"),
    ]
    for args, needle in cases:
        proc = run("bench", "serve", "--out", str(tmp_path), *args)
        assert_clean_error(proc, needle)
    assert not any(tmp_path.iterdir())  # a refused run leaves nothing behind
    assert_clean_error(run("bench", "serve", "--resume", str(tmp_path)), "no config.json")


def test_cli_json_is_results_json(tmp_path):
    proc = run("bench", "serve", "--flow", "dense", "--rate", "100", "--requests", "2", "--input-len", "32",
               "--output-len", "3", "--warmup", "0", "--device", "cpu", "--out", str(tmp_path), "--json",
               "--slo", "ttft=60000")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    (run_dir,) = tmp_path.iterdir()
    assert res == json.loads((run_dir / "results.json").read_text())
    assert [c["flow"] for c in res["cells"]] == ["dense"] and res["cells"][0]["slo"]["attainment"] == 1.0
    assert "P95 TPOT" in proc.stderr or "TPOT" in proc.stderr
