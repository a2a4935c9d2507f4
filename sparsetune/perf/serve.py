"""Latency under serving load (`sparsetune bench serve`): open-loop Poisson arrivals into the
engine's continuous batching, dense and each flow on one warm engine, at each request rate.

The workload is drawn once from the seed: each request's prompt length and output length from the
`--input-len` / `--output-len` mixes, its prompt as random token ids, and a standard exponential gap
before it. At rate r the gaps are scaled by 1/r, so every rate and every flow serves the same
requests and only the time scale changes. A request is added when its arrival time comes whether
the engine is busy or not (open loop), and its latencies count from that arrival time, not from
when the loop got to it: waiting behind a long step is part of them. Steps run back to back while
there is work (the scheduler's chunked prefill, and one token for every running request).

Prefill, two settings:
- `engine` (one node): prompts are prefilled by the same engine, between decode steps: with the
  engine's `schedule` "interleave" (the command's default) one decode step follows each prefill
  chunk; with "prefill_first" every waiting prompt is prefilled before the next decode step.
- `disaggregated`: the decode node of a prefill/decode split (Vortex §6.4.2 measured P1D1). A
  request arrives with its prompt's KV (blocks of the pool, holding whatever they held: speed only),
  the decode flow's fields are built over them, and it joins the decode batch; it is admitted when
  the pool holds its prompt and its whole output beside what the running requests still need, and
  fewer than `max_num_seqs` run. Its TTFT is the wait for room plus its first decode step.

Reuse (`--reuse F,G` with `--workload rag|chat|agent`, `perf/workloads.py`): prompts made of
reusable segments, drawn once from the seed. The cells are `plain` (no caching), `prefix_caching`
(the engine's prefix cache alone) and each reuse flow, all with the decode flow of `--flow` (dense
by default); with `--prefix-caching` the reuse flows keep the prefix cache too (a prompt takes the
cached prefix it starts with, then its segments). Every cell starts from the same cache: emptied, then the workload's corpus stored (for
`prefix_caching` the stored segments are its prefix entries; `plain` stores nothing). Each request
record adds its cache figures (prefix tokens, reused and recomputed tokens), each cell its hit rates
and the KV blocks the cache held at its end, and with a TTFT SLO the run reports each cell's highest
rate whose P95 TTFT meets it (the throughput figure) against plain prompts' and prefix caching's.

Per request, from `Sequence.events` (seconds on the `perf_counter` clock): TTFT (first token -
arrival), TPOT ((finish - first token) / (tokens - 1)), ITL (gaps between consecutive tokens), E2E
(finish - arrival), queue (first scheduled or admitted - arrival). Per (flow, rate) cell: mean and
p50/p95/p99 of each (nearest rank), request and token throughput over the cell, goodput (requests
meeting every SLO target per second) and SLO attainment, and whether the engine kept up: requests
completed at ≥ 90% of the rate they arrived at, measured as (n - 1) / the span of finish times
against (n - 1) / the span of arrival times. A backlog that grows spreads the finishes over a
longer span than the arrivals; an engine that keeps up finishes them as they came. A run whose
arrivals span less than two median E2E latencies never reaches a steady state (every request may
fit in the batch at once, however high the rate), so there the answer is None ("too short to tell";
raise `--requests`).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, model_validator

from sparsetune import records
from sparsetune.engine.config import EngineConfig, split_engine_options
from sparsetune.setup import Setup, resolve
from sparsetune.engine.config_field import EngineField
from sparsetune.errors import SparsetuneError
from sparsetune.perf.workloads import ReuseWorkload, draw

PREFILL_MODES = ("engine", "disaggregated")
KEPT_UP = 0.9  # completions at >= this share of the arrival rate: the engine kept up
STEADY = 2.0  # ... judged only when arrivals span this many median E2E latencies (else kept_up is None)
METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
QUANTILES = (0.5, 0.95, 0.99)
SLO_METRICS = ("ttft", "tpot", "e2e")
CONFIG_SCHEMA = "sparsetune.bench.serve/1"
WARMUP_TOKENS = 16  # a warm-up request's output at most: it compiles and allocates, it is not measured
DEFAULT_FLOWS = ("dense", "block_topk", "quest")
_LENGTH = re.compile(r"\d+")


# ---- the workload ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lengths:
    """A length mix: `N` (every request), `A-B` (uniform integers in [A, B]) or `N:w,M:w` (N with
    weight w, M with weight w, ...)."""

    text: str
    choices: tuple[int, ...]
    weights: tuple[float, ...] | None = None  # None with two choices: the span [choices[0], choices[1]]

    @classmethod
    def parse(cls, text: str, option: str) -> Lengths:
        s = str(text).replace(" ", "")
        hint = f"{option} {text!r}: write N, A-B (uniform) or N:weight,M:weight (a mix), e.g. {option} 4096:0.7,16384:0.3"
        if _LENGTH.fullmatch(s):
            out = cls(s, (int(s),), (1.0,))
        elif re.fullmatch(r"\d+-\d+", s):
            lo, hi = (int(x) for x in s.split("-"))
            if lo > hi:
                raise SparsetuneError(f"{option} {text!r}: the range's low end is above its high end; write {hi}-{lo}")
            out = cls(s, (lo, hi), None)
        elif re.fullmatch(r"\d+:[0-9.]+(,\d+:[0-9.]+)*", s):
            pairs = [p.split(":") for p in s.split(",")]
            try:
                weights = tuple(float(w) for _, w in pairs)
            except ValueError:
                raise SparsetuneError(hint) from None
            if any(not w > 0 for w in weights):
                raise SparsetuneError(f"{option} {text!r}: every weight must be positive")
            out = cls(s, tuple(int(n) for n, _ in pairs), weights)
        else:
            raise SparsetuneError(hint)
        if min(out.choices) < 1:
            raise SparsetuneError(f"{option} {text!r}: lengths must be at least 1 token")
        return out

    @property
    def max(self) -> int:
        return max(self.choices)

    def draw(self, rng: random.Random) -> int:
        if self.weights is None:
            return rng.randint(self.choices[0], self.choices[1])
        return rng.choices(self.choices, self.weights)[0]


@dataclass(frozen=True)
class Request:
    gap: float  # standard exponential: the wait after the previous arrival at rate 1
    input_len: int
    output_len: int


def draw_requests(n: int, input_len: Lengths, output_len: Lengths, seed: int) -> list[Request]:
    """The workload: `n` requests with their lengths and arrival gaps (rate 1), from `seed`."""
    rng = random.Random(seed)
    return [Request(rng.expovariate(1.0), input_len.draw(rng), output_len.draw(rng)) for _ in range(n)]


def arrival_offsets(reqs: list[Request], rate: float) -> list[float]:
    """Seconds from the start of a cell at which each request arrives, at `rate` requests/s (a
    Poisson process: the first request after one gap too)."""
    t, out = 0.0, []
    for r in reqs:
        t += r.gap / rate
        out.append(t)
    return out


def prompt_ids(reqs: list[Request], vocab: int, seed: int) -> list[list[int]]:
    """Each request's prompt: random token ids of its length (the same for every rate and flow)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, r.input_len).tolist() for r in reqs]


# ---- the config -----------------------------------------------------------------------------------

# The flat options (CLI and `sparsetune.bench_serve`) of a reuse run's `ReuseWorkload`, by field.
WORKLOAD_OPTIONS = {"workload": "name", "docs": "docs", "per_prompt": "per_prompt", "doc_len": "doc_len",
                    "question_len": "question_len", "zipf": "zipf", "agents": "agents", "warm_corpus": "warm"}
BASELINES = ("plain", "prefix_caching")  # the reuse run's cells besides its reuse flows


class ServeConfig(BaseModel):
    """Everything that determines a serve benchmark; written to config.json and read back by resume.

    `engine`: the model, device, dtype, weights, KV memory, batch limits and CUDA graphs; `flows` and
    `params` say which flows run (`params`: `key=value` for every flow but dense, `flow:key=value`
    for one flow; None: `DEFAULT_FLOWS`), each resolved into a cell's `Setup` with `defaults` and
    `executor`. With `reuse` (reuse flows, `reuse_params` as `params`) the run is a reuse run: one
    decode flow at most (None: dense), the cells `BASELINES` and each reuse flow, on `workload`
    (`perf/workloads.py`; flat options as `WORKLOAD_OPTIONS` name them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineField = EngineConfig()
    flows: tuple[str, ...] | None = None
    params: tuple[str, ...] = ()
    reuse: tuple[str, ...] = ()
    reuse_params: tuple[str, ...] = ()
    workload: ReuseWorkload = ReuseWorkload()
    defaults: str = "tuned"  # the model's tuned flow defaults under --param, or the flows' published ones
    executor: str | None = None  # a flow's executor (None: compiled on GPU)
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    requests: int = 32
    input_len: str = "1024"
    output_len: str = "128"
    prefill: str = "engine"
    slo: dict[str, float] = {}  # metric (ttft, tpot, e2e) -> milliseconds
    warmup: int = 2  # requests (of at most WARMUP_TOKENS outputs) run before each flow's cells, not measured
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        flows = self.decode_flows
        if not flows:
            raise SparsetuneError("--flow: name at least one flow (e.g. --flow dense,block_topk,quest)")
        if len(set(flows)) != len(flows):
            raise SparsetuneError(f"--flow {','.join(flows)}: a flow is named twice")
        if self.reuse:
            self._check_reuse()
        elif self.reuse_params:
            raise SparsetuneError("--reuse-param describes a reuse run; add --reuse FLOW (e.g. --reuse cacheblend)")
        if not self.rates:
            raise SparsetuneError("--rate: give at least one request rate (requests per second), e.g. --rate 1,2,4")
        bad = [r for r in self.rates if not (r > 0 and math.isfinite(r))]
        if bad:
            raise SparsetuneError(f"--rate {bad[0]}: request rates are positive numbers of requests per second")
        if self.requests < 2:
            raise SparsetuneError(f"--requests must be at least 2 (got {self.requests}): the kept-up test compares "
                                  "the span of arrivals with the span of finishes")
        if self.warmup < 0:
            raise SparsetuneError(f"--warmup must be at least 0 (got {self.warmup})")
        if self.prefill not in PREFILL_MODES:
            raise SparsetuneError(f"--prefill {self.prefill!r}: use one of {', '.join(PREFILL_MODES)}")
        for key, ms in self.slo.items():
            if key not in SLO_METRICS:
                raise SparsetuneError(f"--slo {key}: targets are {', '.join(SLO_METRICS)} in milliseconds, "
                                      "e.g. --slo ttft=2000,tpot=50")
            if not ms > 0:
                raise SparsetuneError(f"--slo {key}={ms}: a target is a positive number of milliseconds")
        self.lengths()
        self.flow_params()
        return self

    def _check_reuse(self) -> None:
        if len(self.decode_flows) > 1:
            raise SparsetuneError(f"--flow {','.join(self.decode_flows)}: a reuse run takes one decode flow at most "
                                  "(it runs in every cell); compare decode flows without --reuse")
        if len(set(self.reuse)) != len(self.reuse):
            raise SparsetuneError(f"--reuse {','.join(self.reuse)}: a flow is named twice")
        clash = [f for f in self.reuse if f in BASELINES]
        if clash:
            raise SparsetuneError(f"--reuse {clash[0]}: {', '.join(BASELINES)} always run; name reuse flows only")
        if self.prefill != "engine":
            raise SparsetuneError("--prefill disaggregated measures decode alone; a reuse run measures prefill: "
                                  "drop --prefill or --reuse")
        if self.input_len != type(self).model_fields["input_len"].default:
            raise SparsetuneError("--input-len: a reuse run's prompts come from its workload; set --doc-len, "
                                  "--per-prompt and --question-len instead")
        self.workload.check()
        self.reuse_flow_params()

    @property
    def decode_flows(self) -> tuple[str, ...]:
        """The decode flows: those given, else `DEFAULT_FLOWS` (dense alone in a reuse run)."""
        if self.flows is not None:
            return self.flows
        return ("dense",) if self.reuse else DEFAULT_FLOWS

    def cell_names(self) -> tuple[str, ...]:
        """What each rate's cells are: the decode flows, or in a reuse run `BASELINES` and the reuse flows."""
        return BASELINES + self.reuse if self.reuse else self.decode_flows

    def reuse_flow_params(self) -> dict[str, dict[str, str]]:
        """Each reuse flow's `--reuse-param` strings: the shared ones, then its own."""
        return _per_flow(self.reuse_params, self.reuse, "--reuse-param", every=True)

    @classmethod
    def of(cls, **options: Any) -> ServeConfig:
        """From flat keyword options, as `sparsetune.bench_serve` takes them: the benchmark's own
        fields and `EngineConfig`'s."""
        engine, own = split_engine_options(options, set(cls.model_fields) - {"engine", "workload"} | set(WORKLOAD_OPTIONS),
                                           "bench serve")
        given = [k for k in own if k in WORKLOAD_OPTIONS]
        if given and not own.get("reuse"):
            raise SparsetuneError(f"--{given[0].replace('_', '-')} describes a reuse run; add --reuse FLOW (e.g. "
                                  "--reuse cacheblend)")
        workload = ReuseWorkload(**{WORKLOAD_OPTIONS[k]: own.pop(k) for k in given})
        return cls(engine=engine, workload=workload, **own)

    def lengths(self) -> tuple[Lengths, Lengths]:
        return Lengths.parse(self.input_len, "--input-len"), Lengths.parse(self.output_len, "--output-len")

    def flow_params(self) -> dict[str, dict[str, str]]:
        """Each flow's `--param` strings: the shared ones (not for dense), then its own."""
        return _per_flow(self.params, self.decode_flows, "--param", every=False)

    def setup(self, cell: str) -> Setup:
        """The setup of a cell (`cell_names`): the engine's options, its decode flow with its params, and
        in a reuse run prefix caching (`prefix_caching`) or the reuse flow with its params (`resolve`)."""
        if not self.reuse:
            return resolve(self.engine, flow=None if cell == "dense" else cell, params=self.flow_params()[cell],
                           executor=self.executor, defaults=self.defaults)
        flow = self.decode_flows[0]
        reuse = None if cell in BASELINES else cell
        # Reuse flows keep the engine's prefix caching (`--prefix-caching`: a prefix hit, then segments).
        caching = cell == "prefix_caching" or (reuse is not None and self.engine.prefix_caching)
        return resolve(replace(self.engine, prefix_caching=caching),
                       flow=None if flow == "dense" else flow, params=self.flow_params()[flow], reuse=reuse,
                       reuse_params=self.reuse_flow_params()[cell] if reuse else None, executor=self.executor,
                       defaults=self.defaults)

    def with_dense(self) -> ServeConfig:
        """Dense first (every reduction is against it), then the other flows as given (a reuse run: as
        it is, its baselines first)."""
        if self.reuse:
            return self
        return self.model_copy(update={"flows": ("dense",) + tuple(f for f in self.decode_flows if f != "dense")})


def _per_flow(args: tuple[str, ...], flows: tuple[str, ...], option: str, every: bool) -> dict[str, dict[str, str]]:
    """`key=value` strings for every flow (but dense unless `every`) and `flow:key=value` for one, per flow."""
    from sparsetune.flow.params import params_per_flow, parse_param_args

    what = "--reuse" if option == "--reuse-param" else "--flow"
    return params_per_flow(parse_param_args(list(args), option), flows, option, what, () if every else ("dense",))


def check_serve(cfg: ServeConfig) -> None:
    """The checks that need no weights: the engine options, the model and its positions, each flow's
    kind and params (and its layers against the model's: a flow is switched in after dense has run)."""
    from sparsetune.flow.params import Flow, unknown_param
    from sparsetune.loader import flow_kind
    from sparsetune.setup import lookup_flow_class

    name, mcfg = cfg.engine.check()
    inp, out = cfg.lengths()
    if cfg.reuse:
        longest = cfg.workload.max_prompt_len(out.max)
        if longest + out.max > mcfg.max_position_embeddings:
            raise SparsetuneError(f"the {cfg.workload.name} workload's prompts (up to {longest} tokens) plus --output-len up "
                                  f"to {out.max} exceed {name}'s {mcfg.max_position_embeddings} positions; lower "
                                  "--doc-len or --per-prompt")
    elif inp.max + out.max > mcfg.max_position_embeddings:
        raise SparsetuneError(f"--input-len up to {inp.max} plus --output-len up to {out.max} exceeds {name}'s "
                              f"{mcfg.max_position_embeddings} positions; lower them")
    for flow, params in cfg.reuse_flow_params().items():
        if flow_kind(lookup_flow_class(flow, Flow)) != "reuse":
            raise SparsetuneError(f"--reuse {flow}: a decode flow; name decode flows with --flow")
        cfg.setup(flow)  # its params, and the decode flow with it
    for flow, params in cfg.flow_params().items():
        if flow == "dense":
            if params:
                raise SparsetuneError(f"--param dense:{next(iter(params))}=...: dense has no params")
            continue
        cls = lookup_flow_class(flow, Flow)
        if flow_kind(cls) != "decode":
            raise SparsetuneError(f"--flow {flow}: a {flow_kind(cls)} flow; bench serve runs decode flows with --flow "
                                  "and reuse flows with --reuse")
        specs = cls.param_specs()
        for key in params:
            if key not in specs:
                raise unknown_param(flow, key, specs, any(p.partition("=")[0] == f"{flow}:{key}" for p in cfg.params))
        if not cfg.reuse:
            cfg.setup(flow)  # its params over the tuned defaults, its layers against the model's
    if cfg.reuse:
        cfg.setup("plain")


# ---- one cell: a flow at a rate ---------------------------------------------------------------------

class _Admission:
    """Puts an arrived request into the engine: `engine` prefill adds it to the scheduler;
    `disaggregated` writes nothing (its KV is taken as arrived), builds its flow fields and admits it
    to the decode batch once the pool and `max_num_seqs` have room for it."""

    def __init__(self, llm, prefill: str) -> None:
        self.llm, self.prefill = llm, prefill
        self.reuse: dict[int, Any] = {}  # request id → its reuse prefill's stats (`ReuseStats`)

    def __call__(self, ids, params, arrival: float):
        """`ids`: the prompt's token ids, or its `ReuseLayout` (a reuse run's prompt)."""
        from sparsetune.reuse.parts import ReuseLayout

        llm = self.llm
        if isinstance(ids, ReuseLayout):
            seq, stats = llm.add_parts(ids, params, arrival)
            if stats is not None:
                self.reuse[seq.seq_id] = stats
            return seq
        if self.prefill == "engine":
            return llm.engine.add_request(ids, params, arrival)
        sched, blocks = llm.engine.scheduler, llm.engine.block_manager
        if len(sched.running) >= llm.config.max_num_seqs:
            return None
        owed = sum(blocks.blocks_needed(s, s.num_prompt_tokens + s.params.max_tokens) for s in sched.running)
        if blocks.num_free - owed < -(-(len(ids) + params.max_tokens) // blocks.block_size):
            return None
        return llm.add_prefilled(ids, params, arrival=arrival)

    def idle_refusal(self, n_tokens: int) -> SparsetuneError:
        return SparsetuneError(f"a request of {n_tokens} tokens does not fit in the idle engine's KV pool "
                               f"({self.llm.engine.block_manager.num_blocks} blocks of {self.llm.config.block_size}); "
                               "raise --kv-memory or lower --input-len/--output-len")


def run_requests(llm, reqs: list[Request], ids: list[list[int]], offsets: list[float], prefill: str = "engine",
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 on_finish: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Serve `reqs` arriving at `offsets` seconds from now (open loop) on `llm` (an idle `LLM`, or
    anything with its request API); each request's record (`request_record`), in arrival order.
    `on_finish(n)`: n requests have finished so far."""
    from sparsetune.engine.sequence import SamplingParams

    from sparsetune.reuse.parts import ReuseLayout

    if llm.engine.scheduler.has_work():
        raise RuntimeError("run_requests needs an idle engine")
    admit = _Admission(llm, prefill)
    reuse_run = bool(ids) and isinstance(ids[0], ReuseLayout)
    t0 = clock()
    arrivals = [t0 + o for o in offsets]
    seqs: list[Any] = [None] * len(reqs)
    waiting: deque[int] = deque()  # arrived, not yet in the engine (disaggregated: no room yet)
    nxt, finished = 0, 0
    try:
        while nxt < len(reqs) or waiting or llm.engine.scheduler.has_work():
            now = clock()
            while nxt < len(reqs) and arrivals[nxt] <= now:
                waiting.append(nxt)
                nxt += 1
            while waiting:
                i = waiting[0]
                params = SamplingParams(max_tokens=reqs[i].output_len, ignore_eos=True)
                seq = admit(ids[i], params, arrivals[i])
                if seq is None:
                    break
                seqs[i] = seq
                waiting.popleft()
            if llm.engine.scheduler.has_work():
                done = llm.engine.step()
                if done and on_finish is not None:
                    finished += len(done)
                    on_finish(finished)
            elif waiting:
                raise admit.idle_refusal(reqs[waiting[0]].input_len + reqs[waiting[0]].output_len)
            elif nxt < len(reqs):
                sleep(max(0.0, arrivals[nxt] - clock()))
    except BaseException:
        for seq in seqs:  # an interrupted cell leaves the engine idle for the next one
            if seq is not None:
                llm.engine.abort(seq)
        raise
    return [request_record(i, r, s, t0, admit.reuse.get(s.seq_id), reuse_run) for i, (r, s) in enumerate(zip(reqs, seqs))]


def request_record(i: int, req: Request, seq, t0: float, reuse=None, cache: bool = False) -> dict[str, Any]:
    """One request's latencies in seconds, from its events; `arrival_s` from the cell's start. With
    `cache` (a reuse run), its cache figures: prompt tokens taken from the prefix cache, and from
    its reuse prefill's stats (`reuse`) the tokens reused (found stored, or filled for it first:
    misses) and those recomputed."""
    ev = seq.events
    toks = ev.tokens
    n = len(toks)
    figures = {}
    if cache:
        figures = {"prefix_tokens": seq.num_cached_tokens,
                   **{k: getattr(reuse, k) if reuse is not None else 0
                      for k in ("reused_tokens", "stored_tokens", "filled_tokens", "segment_misses")},
                   "recomputed_tokens": reuse.recomputed_reused if reuse is not None else 0}
    return {**figures,
        "i": i, "arrival_s": ev.arrival - t0, "input_len": req.input_len, "output_len": req.output_len,
        "output_tokens": n, "finish_reason": seq.finish_reason,
        "ttft_s": ev.first_token - ev.arrival,
        "tpot_s": (ev.finished - ev.first_token) / (n - 1) if n > 1 else None,
        "e2e_s": ev.finished - ev.arrival,
        "queue_s": ev.scheduled - ev.arrival,
        "finish_s": ev.finished - t0,
        "itl_s": [b - a for a, b in zip(toks, toks[1:])],
    }


def _stats(values: list[float]) -> dict[str, float] | None:
    from sparsetune.perf.timing import percentile

    if not values:
        return None
    out = {"mean": 1e3 * sum(values) / len(values)}
    out.update({f"p{round(q * 100)}": 1e3 * percentile(values, q) for q in QUANTILES})
    return {k: round(v, 3) for k, v in out.items()}


def summarize(recs: list[dict[str, Any]], rate: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """A cell's figures from its request records (milliseconds; rates per second)."""
    n = len(recs)
    arrive = sorted(r["arrival_s"] for r in recs)
    finish = sorted(r["finish_s"] for r in recs)
    duration = finish[-1]  # from the cell's start to the last finish
    out_tokens = sum(r["output_tokens"] for r in recs)
    in_tokens = sum(r["input_len"] for r in recs)
    arrival_rate = (n - 1) / (arrive[-1] - arrive[0]) if arrive[-1] > arrive[0] else None
    finish_rate = (n - 1) / (finish[-1] - finish[0]) if finish[-1] > finish[0] else None
    e2e = sorted(r["e2e_s"] for r in recs)[n // 2]
    steady = arrival_rate is not None and arrive[-1] - arrive[0] >= STEADY * e2e
    kept = (finish_rate is None or finish_rate >= KEPT_UP * arrival_rate) if steady else None
    cell: dict[str, Any] = {
        "rate": rate, "requests": n, "duration_s": round(duration, 4),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": round(n / duration, 4), "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "arrival_rate": None if arrival_rate is None else round(arrival_rate, 4),
        "finish_rate": None if finish_rate is None else round(finish_rate, 4),
        "kept_up": kept,
    }
    for m in METRICS:
        vals = [x for r in recs for x in r["itl_s"]] if m == "itl" else [r[f"{m}_s"] for r in recs if r[f"{m}_s"] is not None]
        cell[f"{m}_ms"] = _stats(vals)
    if slo:
        good = sum(all(r[f"{k}_s"] is not None and 1e3 * r[f"{k}_s"] <= ms for k, ms in slo.items()) for r in recs)
        cell["slo"] = {"targets_ms": dict(slo), "attainment": round(good / n, 4), "goodput": round(good / duration, 4)}
    if "prefix_tokens" in recs[0]:  # a reuse run: how much of the prompts the cache served
        total = {k: sum(r[k] for r in recs)
                 for k in ("prefix_tokens", "reused_tokens", "stored_tokens", "filled_tokens", "recomputed_tokens",
                           "segment_misses")}
        # Computed: what neither cache served, the recomputed reused tokens, and the fills run for it.
        computed = (in_tokens - total["prefix_tokens"] - total["reused_tokens"] + total["recomputed_tokens"]
                    + total["filled_tokens"])
        cell["cache"] = {"prefix_hit_rate": round(total["prefix_tokens"] / in_tokens, 4),
                         "segment_hit_rate": round(total["stored_tokens"] / in_tokens, 4),
                         "recompute_rate": round(total["recomputed_tokens"] / max(1, total["reused_tokens"]), 4),
                         "computed_rate": round(computed / in_tokens, 4),
                         "segment_misses": total["segment_misses"]}
    return cell


def slo_rates(cells: list[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any] | None:
    """A reuse run's throughput figure: per cell name the highest rate whose P95 TTFT meets the TTFT
    SLO (None: no rate did), and its ratio to plain prompts' and to prefix caching's. None without a
    TTFT target."""
    if "ttft" not in slo:
        return None
    best: dict[str, float | None] = {}
    for c in cells:
        ok = c["ttft_ms"] is not None and c["ttft_ms"]["p95"] <= slo["ttft"]
        best.setdefault(c["flow"], None)
        if ok and (best[c["flow"]] is None or c["rate"] > best[c["flow"]]):
            best[c["flow"]] = c["rate"]
    ratio = lambda a, b: None if a is None or not b else round(a / b, 3)  # noqa: E731
    return {"ttft_p95_slo_ms": slo["ttft"], "max_rate": best,
            "over": {base: {name: ratio(rate, best.get(base)) for name, rate in best.items() if name != base}
                     for base in BASELINES if base in best}}


def reductions(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Dense's figures over each flow's at two rates: the highest rate at which dense kept up, and
    the highest rate measured. `tpot_p95` = dense's P95 TPOT / the flow's (a reduction factor)."""
    dense = {c["rate"]: c for c in cells if c["flow"] == "dense"}
    kept = [r for r, c in dense.items() if c["kept_up"]]
    out: dict[str, Any] = {"dense_max_kept_up_rate": max(kept) if kept else None, "at": {}}
    for label, rate in (("max_kept_up_rate", out["dense_max_kept_up_rate"]), ("max_rate", max(dense, default=None))):
        if rate is None:
            continue
        row = {}
        for c in cells:
            if c["flow"] == "dense" or c["rate"] != rate:
                continue
            row[c["flow"]] = {f"{m}_{q}": _ratio(dense[rate][f"{m}_ms"], c[f"{m}_ms"], q)
                              for m in ("tpot", "ttft", "e2e") for q in ("p50", "p95", "p99")}
            row[c["flow"]]["kept_up"] = c["kept_up"]
        out["at"][label] = {"rate": rate, "flows": row}
    return out


def _ratio(dense: dict | None, flow: dict | None, q: str) -> float | None:
    if not dense or not flow or not flow[q]:
        return None
    return round(dense[q] / flow[q], 3)


# ---- the benchmark: every flow at every rate, recorded as it goes ---------------------------------

def _cell_key(flow: str, rate: float) -> str:
    return f"{flow}@{rate:g}"


def load_resume(run_dir: Path) -> tuple[ServeConfig, dict[str, Any]]:
    """An interrupted benchmark's config and its results so far."""
    what = "pass a run directory made by sparsetune bench serve"
    raw = records.read_run_config(run_dir, "sparsetune bench serve")
    try:
        if not isinstance(raw, dict) or raw.get("schema") != CONFIG_SCHEMA:
            raise ValueError(f"schema {raw.get('schema') if isinstance(raw, dict) else None!r}, not {CONFIG_SCHEMA}")
        cfg = ServeConfig.model_validate(raw["serve"])
        results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").is_file() else {}
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SparsetuneError(f"--resume {run_dir}: config.json or results.json is unreadable ({e}); {what}") from None
    return cfg, results


def serve_benchmark(cfg: ServeConfig | None = None, *, out: Path | str | None = None, resume: Path | str | None = None,
                    llm=None, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run (or finish, with `resume`) a serve benchmark; returns results.json's object. Each cell's
    figures and request records are written as soon as it ends, so an interrupted run keeps them
    and `resume` runs only the cells it lacks. `on_event(kind, data)`: "start" {run_dir, cells,
    done, requests (to run)}, "cell" {flow, rate, index}, "finish" {flow, rate, finished, requests}, "warmup" {flow},
    "cell_done" {cell}."""
    emit = on_event or (lambda kind, data: None)
    if resume is not None:
        run_dir = Path(resume)
        cfg, results = load_resume(run_dir)
    else:
        cfg = (cfg or ServeConfig()).with_dense()
        results = {}
    check_serve(cfg)
    from sparsetune.llm import LLM

    inp, outl = cfg.lengths()
    if llm is None:
        llm = LLM(cfg.setup(cfg.cell_names()[0]))
    from sparsetune.perf.admission import SERVE, check_fits

    if resume is None:
        run_dir = records.new_run_dir(out, "serve", cfg.engine.model)
        records.write_json(run_dir / "config.json", {"schema": CONFIG_SCHEMA, "serve": cfg.model_dump(mode="json")})
        records.write_json(run_dir / "env.json", records.env_info(llm.device))
    cells: list[dict[str, Any]] = list(results.get("cells", []))
    done = {_cell_key(c["flow"], c["rate"]) for c in cells}
    # request lines of cells that did not finish go (a crash between a cell's two writes leaves them)
    records.keep_lines(run_dir / "requests.jsonl", lambda rec: _cell_key(rec["flow"], rec["rate"]) in done)
    names, vocab = cfg.cell_names(), llm.model_config.vocab_size
    reqs = draw_requests(cfg.requests, inp, outl, cfg.seed)
    warm = [replace(r, output_len=min(r.output_len, WARMUP_TOKENS)) for r in draw_requests(cfg.warmup, inp, outl, cfg.seed + 1)]
    corpus: list = []
    if cfg.reuse:  # prompts of segments, and the corpus each cell starts with
        drawn = draw(cfg.workload, len(reqs), vocab, cfg.seed, [r.output_len for r in reqs])
        ids, corpus = drawn.layouts, drawn.corpus
        # Warmed up on the workload's own first prompts (the cache is reset after), so the shapes a
        # cell meets (prefix hits' attention behind cached keys) are compiled before it.
        warm_ids = [ids[i % len(ids)] for i in range(len(warm))]
        reqs = [replace(r, input_len=x.num_tokens) for r, x in zip(reqs, ids)]
        warm = [replace(r, input_len=x.num_tokens) for r, x in zip(warm, warm_ids)]
    else:
        ids, warm_ids = prompt_ids(reqs, vocab, cfg.seed), prompt_ids(warm, vocab, cfg.seed + 1)
    longest = max(r.input_len for r in reqs) if cfg.reuse else inp.max
    todo = [(f, r) for f in names for r in cfg.rates if _cell_key(f, r) not in done]
    emit("start", {"run_dir": str(run_dir), "cells": len(names) * len(cfg.rates), "done": len(done),
                   "requests": len(todo) * len(reqs)})

    def save() -> dict[str, Any]:
        have = {_cell_key(c["flow"], c["rate"]) for c in cells}
        res = {"model": llm.resolved.name, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
               "random_weights": llm.resolved.random_weights, "prefill": cfg.prefill, "cells": cells,
               "reductions": reductions(cells), "run_dir": str(run_dir),
               "complete": all(_cell_key(f, r) in have for f in names for r in cfg.rates)}
        if cfg.reuse:
            res.update(workload=cfg.workload.name, slo_rates=slo_rates(cells, cfg.slo))
        records.write_json(run_dir / "results.json", res)
        return res

    current = None
    for index, (flow, rate) in enumerate(todo):
        cell_corpus = corpus if flow != "plain" else []  # plain prompts: no cache at all
        if flow != current:
            llm.apply(cfg.setup(flow))
            check_fits(llm.engine, 1, longest, outl.max, SERVE)
            if cfg.reuse:
                _check_reuse_fits(llm, longest + outl.max)
            current = flow
            if warm:
                emit("warmup", {"flow": flow})
                if cfg.reuse:  # warmed up on the cache it serves from (prefix hits compile their attention too)
                    _reset_cache(llm, cell_corpus)
                run_requests(llm, warm, warm_ids, [0.0] * len(warm), cfg.prefill)
        if cfg.reuse:  # every cell starts from the same cache: the corpus stored, nothing else
            _reset_cache(llm, cell_corpus)
        emit("cell", {"flow": flow, "rate": rate, "index": index})
        recs = run_requests(llm, reqs, ids, arrival_offsets(reqs, rate), cfg.prefill,
                            on_finish=lambda n, f=flow, r=rate: emit("finish", {"flow": f, "rate": r, "finished": n,
                                                                               "requests": len(reqs)}))
        cell = {"flow": flow, "params": llm.flow.params() if llm.flow is not None else {}, "setup": llm.setup.to_dict(),
                **summarize(recs, rate, cfg.slo)}
        if cfg.reuse:
            cell["cache"]["blocks"] = len(llm.segments.block_ids() | set(llm.engine.block_manager.block_hash))
        with open(run_dir / "requests.jsonl", "a") as f:
            for r in recs:
                f.write(json.dumps({"flow": flow, "rate": rate, **_rounded(r)}) + "\n")
        cells.append(cell)
        save()
        emit("cell_done", {"cell": cell})
    res = save()
    plot(res, run_dir / "latency.png")
    return res


def _reset_cache(llm, corpus: list) -> None:
    """Empty the cache but for `corpus` (layouts of one segment each), and store what it lacks of it.
    With prefix caching on, a kept segment must be a prefix entry too (its full blocks hashed: stored
    while prefix caching was on); one that is not goes and is stored again."""
    segments, bm = llm.segments, llm.engine.block_manager
    keep = set()
    for x in corpus:
        key = segments.key(x.token_ids, x.spans[0].namespace)
        seg = segments.get(key)
        full = [] if seg is None else seg.blocks[: seg.num_tokens // bm.block_size]
        if seg is not None and (not llm.engine.config.prefix_caching or all(b in bm.block_hash for b in full)):
            keep.add(key)
    segments.clear(keep)
    bm.forget_prefixes(keep=segments.block_ids())
    if corpus:
        llm.cache_segments(corpus)


def _check_reuse_fits(llm, tokens: int) -> None:
    """A reuse request of `tokens` (prompt and output) and the segments it reuses fit the pool together."""
    bm = llm.engine.block_manager
    need = 2 * bm.blocks_for(tokens)
    if need > bm.num_blocks:
        raise SparsetuneError(f"a reuse request of {tokens} tokens and the segments it reuses need about {need} KV "
                              f"blocks together; the pool has {bm.num_blocks}: raise --kv-memory or lower --doc-len "
                              "or --per-prompt")


def _rounded(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else [round(x, 6) for x in v] if isinstance(v, list) else v)
            for k, v in rec.items()}


def plot(result: dict[str, Any], path: Path | str) -> Path:
    """P95 TPOT and P95 TTFT against the request rate, a line per flow: filled where the engine kept
    up, hollow where it did not, a hollow diamond where the run was too short to tell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    flows = list(dict.fromkeys(c["flow"] for c in result["cells"]))
    for ax, metric, label in ((axes[0], "tpot_ms", "P95 TPOT (ms)"), (axes[1], "ttft_ms", "P95 TTFT (ms)")):
        for flow in flows:
            cs = sorted((c for c in result["cells"] if c["flow"] == flow and c[metric]), key=lambda c: c["rate"])
            if not cs:
                continue
            line, = ax.plot([c["rate"] for c in cs], [c[metric]["p95"] for c in cs], "-", label=flow)
            for c in cs:
                ax.plot(c["rate"], c[metric]["p95"], "o" if c["kept_up"] is not None else "D", color=line.get_color(),
                        markerfacecolor=line.get_color() if c["kept_up"] else "white")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{result['model']} on {result['device']}, prefill {result['prefill']} (filled: the engine kept "
                 "up; hollow: it did not; diamond: the run was too short to tell)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
