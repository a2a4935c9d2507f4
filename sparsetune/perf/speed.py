"""Speed of one engine configuration on synthetic prompts: TTFT, decode rate, TPOT, peak memory.

All `batch` requests (random token ids of `context` tokens each) are submitted at once and run
to `gen_tokens` new tokens with EOS ignored, so every configuration does the same work. Each
engine step is timed by `perf.timing.time_call` (host wall time, device synchronised, so GPU work
is included); a request's TTFT is its first token's event (`seq.events.first_token`) from the start
of the run. A short warm-up run first pays for kernel compilation and graph capture.
"""

from __future__ import annotations

import resource
import statistics
import time
from typing import Any

import torch

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams
from sparsetune.errors import SparsetuneError
from sparsetune.perf.admission import check_fits
from sparsetune.perf.timing import percentile, time_call


def _run(llm: LLM, batch: int, context: int, gen_tokens: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
    seqs = [llm.engine.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    decode_steps: list[float] = []
    decode_tokens = 0
    prefill_s = 0.0
    t0 = time.perf_counter()
    while llm.engine.scheduler.has_work():
        before, before_prefill = llm.stats.decode_tokens, llm.stats.prefill_tokens
        dt = time_call(llm.engine.step, llm.device)
        if llm.stats.prefill_tokens > before_prefill:
            prefill_s += dt
        else:  # a decode step (with overlap, the first only launches: its tokens come with the next)
            decode_steps.append(dt)
            decode_tokens += llm.stats.decode_tokens - before
    total = time.perf_counter() - t0
    ttft = sorted(s.events.first_token - t0 for s in seqs)  # from the submitted batch's start
    decode_s = sum(decode_steps)
    return {
        "ttft_s": {"p50": round(statistics.median(ttft), 5), "max": round(ttft[-1], 5)},
        "prefill_tokens_per_s": round(batch * context / prefill_s, 1) if prefill_s > 0 else None,
        "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else None,
        "tpot_ms": None if not decode_steps else {
            "p50": round(1e3 * statistics.median(decode_steps), 4),
            "p95": round(1e3 * percentile(decode_steps, 0.95), 4),
        },
        "decode_steps": len(decode_steps),
        "total_s": round(total, 4),
    }


def measure_speed(llm: LLM, batch: int, context: int, gen_tokens: int, seed: int = 0) -> dict[str, Any]:
    """TTFT, decode tokens/s, TPOT p50/p95 and peak memory for `batch` × `context` prompts."""
    if batch < 1 or context < 1 or gen_tokens < 2:
        raise SparsetuneError("speed needs --batch >= 1, --context >= 1 and --max-new-tokens >= 2")
    check_fits(llm.engine, batch, context, gen_tokens)
    preempted = llm.engine.scheduler.num_preemptions
    _run(llm, batch, min(context, 256), 4, seed + 1)  # warm-up: compilation, graph capture, allocator
    cuda = llm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(llm.device)
        torch.cuda.reset_peak_memory_stats(llm.device)
    out = _run(llm, batch, context, gen_tokens, seed)
    if cuda:
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(llm.device)
        out["peak_memory_kind"] = "torch.cuda.max_memory_allocated (includes the preallocated KV pool)"
    else:
        out["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["peak_memory_kind"] = "process peak RSS (whole process, all phases)"
    out["kv_pool_bytes"] = 2 * llm.engine.kv.k.numel() * llm.engine.kv.k.element_size()
    out.update(batch=batch, context=context, gen_tokens=gen_tokens,
               preemptions=llm.engine.scheduler.num_preemptions - preempted)
    return out


def speed_engine(model: str, random_weights: bool, batch: int, context: int, device=None, seed: int = 0) -> LLM:
    """The engine a decode speed is measured on (the search's measured speed, the cost model's
    data): `batch` sequences of `context` tokens, K and V for them in the pool (a flow's fields
    come on top: a block-size change keeps the tokens, so a flow whose fields do not fit beside them
    fails, with the reason), CUDA graphs at `batch`. Sequences are no longer than the measured
    ones: the decode graphs' block tables (and a small-unit flow's top-k row) are as wide as the
    longest sequence the engine admits, not the model's context (at 2-token units, 40K tokens
    overflow the radix select's row: BENCHMARKS.md, #43)."""
    from sparsetune.device import resolve_device, resolve_dtype
    from sparsetune.models.resolve import model_config

    dtype = resolve_dtype(None, resolve_device(device), "bfloat16")
    per_token = model_config(model, random_weights)[1].kv_bytes_per_token(dtype.itemsize)
    return LLM(model=model, random_weights=random_weights, device=device, max_num_seqs=batch, defaults="published",
               kv_memory=batch * (context + 64) * per_token, seed=seed, cuda_graph_batch_sizes=(batch,),
               max_model_len=context + 64)


def decode_step_seconds(llm: LLM, batch: int, context: int, steps: int = 16, warmup: int = 3, seed: int = 0) -> float:
    """Median seconds of one decode step of `batch` requests at `context` tokens, without a prefill:
    the requests take blocks holding whatever KV the pool has (the step reads the same bytes and
    runs the same kernels), the decode flow's fields are built over them, and steps are timed as
    the engine runs them (CUDA graphs where captured). The engine is idle again afterwards."""
    from sparsetune.perf.timing import time_calls

    if llm.engine.scheduler.has_work():
        raise RuntimeError("decode_step_seconds needs an idle engine")
    check_fits(llm.engine, batch, context, warmup + steps + 1)
    g = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True)
    seqs = []
    try:
        for _ in range(batch):
            seqs.append(llm.add_prefilled(torch.randint(0, vocab, (context,), generator=g).tolist(), params))
        return statistics.median(time_calls(llm.engine.step, llm.device, steps, warmup))
    finally:
        for seq in seqs:
            llm.engine.abort(seq)


# ---- reuse prefill: time to first token on a prompt whose bulk is reused segments ------------------

def _random_text(n: int, rng) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n))


def reuse_prompt(context: int, ratio: float = 0.9, segments: int = 9, seed: int = 0, tokenizer=None) -> list:
    """Prompt parts for `LLM.generate`: a plain prefix, `segments` reusable segments holding `ratio`
    of the text, a plain suffix; about `context` tokens of `tokenizer` (exactly, with random
    weights' byte tokenizer: one token per character; None: that one)."""
    import random

    rng = random.Random(seed)
    if tokenizer is not None:  # characters per token of this text, measured on a sample of it
        sample = _random_text(4096, random.Random(seed + 1))
        context = round(context * len(sample) / max(1, len(tokenizer.encode(sample))))
    seg_len = int(context * ratio) // segments
    new = context - seg_len * segments
    parts: list = [_random_text(new // 2, rng)]
    parts += [{"text": _random_text(seg_len, rng), "reuse": True, "namespace": "speed"} for _ in range(segments)]
    parts.append(_random_text(new - new // 2, rng))
    return parts


def store_segments(llm: LLM, parts: list) -> dict[str, Any]:
    """Stage 1: one request with `pie` stores every segment of `parts` in the segment cache; the
    engine's reuse flow is put back. Returns that request's reuse stats."""
    flow = llm.reuse_flow
    llm.use_reuse("pie")
    try:
        return llm.generate([parts], SamplingParams(max_tokens=1, ignore_eos=True), chat=False)[0].reuse
    finally:
        llm.use_reuse(flow)


def reuse_ttft_seconds(llm: LLM, parts: list, repeats: int = 3, warmup: int = 1) -> tuple[float, dict[str, Any]]:
    """Median time to first token of the engine's reuse flow on `parts` (its segments stored by
    `store_segments`), after `warmup` requests (allocator, kernels' first launch), and the last
    request's reuse stats."""
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(warmup):
        llm.generate([parts], once, chat=False)
    runs = [llm.generate([parts], once, chat=False)[0].reuse for _ in range(repeats)]
    return statistics.median(r["seconds"] for r in runs), runs[-1]
