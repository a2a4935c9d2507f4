"""`evaluate`: how much accuracy a flow keeps and how much faster it is, recorded as a run directory.

One engine serves every pass (same weights and KV pool; `LLM.apply` switches attention):
  dense pass   greedy answers with full attention, keeping each generated position's logits
  flow pass    greedy answers with the flow: accuracy
  forced pass  the dense answers teacher-forced through the flow: fidelity (cosine, top-1, top-10)
  speed        synthetic prompts of --context tokens at --batch: the flow, then dense for the speedup
Samples are processed in chunks; each finished sample is appended to `samples.jsonl` and
`results.json` is rewritten from those records, so an interrupted run leaves a readable partial
record (`complete: false`) and `resume=` continues it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams, Sequence, Status
from sparsetune.errors import SparsetuneError
from sparsetune.evaluation.config import (CONFIG_SCHEMA, DEFAULT_SPEED_TOKENS, EvalConfig, check_config,
                                          load_resume_config)
from sparsetune.evaluation.fidelity import FidelityTally
from sparsetune.evaluation.reference import DenseReference, PromptKV
from sparsetune.evaluation.results import SCHEMA, EvalResult
from sparsetune.evaluation.samples import Sample, prompt_ids, prompt_layout
from sparsetune.evaluation.scoring import score_turns
from sparsetune.perf.cost import attended_tokens, forced_only
from sparsetune.perf.admission import EVAL, SAMPLE, check_fits
from sparsetune.perf.speed import measure_speed
from sparsetune.records import env_info, new_run_dir, read_lines, write_json
from sparsetune.setup import Setup

# on_progress(done, total, what): called as work completes; may raise KeyboardInterrupt to stop.
ProgressFn = Callable[[float, int, str], None]  # done may be fractional mid-chunk


def _resolve_mode(cfg: EvalConfig, device: torch.device) -> str:
    if cfg.mode == "auto":
        return "speed" if cfg.setup.engine.random_weights else ("all" if device.type == "cuda" else "accuracy")
    return cfg.mode


def eval_kv_memory(model: str, batch: int, context: int, gen_tokens: int = 512, device: str | None = None,
                   dtype: str | None = None, random_weights: bool = False, segments: bool = False) -> int:
    """KV pool bytes for `batch` requests of `context` tokens (+10% sizing slack, turns and replies),
    and with `segments` (a reuse flow) the segments those prompts reuse beside them (a request
    holds its segments while its own blocks fill). A pool sized to the work (rather than to free GPU
    memory) leaves room for flow fields, which a flow switched on later allocates per block of the pool."""
    from sparsetune.device import resolve_device, resolve_dtype
    from sparsetune.models.resolve import resolve_model

    resolved = resolve_model(model, True)
    gpu_dtype = resolved.spec.gpu_dtype if resolved.spec else "bfloat16"
    elem = resolve_dtype(dtype, resolve_device(device), gpu_dtype).itemsize
    tokens = batch * ((2 if segments else 1) * int(context * 1.1) + gen_tokens)
    return tokens * resolved.config.kv_bytes_per_token(elem)


def run_engine_config(cfg: EvalConfig) -> Setup:
    """The setup a run builds its engine from: the config's, with `batch` as its request limit and
    CUDA-graph batch sizes, and a KV pool sized to the work unless `kv_memory` is given."""
    e = cfg.setup.engine
    kv_memory = e.kv_memory
    if kv_memory is None:
        kv_memory = eval_kv_memory(e.model, cfg.batch, cfg.context, max(512, cfg.max_new_tokens or DEFAULT_SPEED_TOKENS),
                                   e.device, e.dtype, e.random_weights, segments=cfg.setup.reuse is not None)
    return replace(cfg.setup, engine=replace(e, kv_memory=kv_memory, max_num_seqs=cfg.batch,
                                             cuda_graph_batch_sizes=graph_batch_sizes(cfg.batch)))


def graph_batch_sizes(batch: int) -> tuple[int, ...]:
    """CUDA-graph batch sizes for runs of at most `batch` requests: powers of two, and `batch`."""
    return tuple(sorted({1 << i for i in range(batch.bit_length())} | {batch}))


def _ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


# ---- accuracy and fidelity ------------------------------------------------------------------------

@dataclass
class _Pass:
    """One pass over a chunk of samples: per sample, per turn, the reply and its token ids / logits."""

    texts: list[list[str]]
    tokens: list[list[list[int]]]
    logits: list[list[list[torch.Tensor]]]
    prompts: list[list[list[int]]]
    reuse: list[dict | None]  # per sample: the reuse prefill's stats (with a reuse flow and segments)


def _run_pass(llm: LLM, samples: list[Sample], cfg: EvalConfig, keep_logits: bool,
              forced: _Pass | None = None, tick: Callable[[int], None] | None = None,
              reference: DenseReference | None = None, record: bool = False) -> _Pass:
    """Greedy turns for a chunk of samples; multi-turn samples feed back their own earlier replies
    (or, when `forced`, the dense pass's replies and tokens). `tick(n)`: n more turns finished.
    `reference`: a turn whose prompt it holds starts from the stored KV (first turns; later turns
    whose history equals the dense pass's: the forced pass's, and a flow's that answered as dense
    did); `record` (the dense pass, keeping logits): store each turn's prompt KV once prefilled."""
    tok = llm.tokenizer
    n = len(samples)
    out = _Pass([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)], [None] * n)
    for turn in range(max(len(s.turns) for s in samples)):
        rows = [i for i, s in enumerate(samples) if turn < len(s.turns)]
        prompts, params, layouts = [], [], []
        for i in rows:
            s = samples[i]
            history = forced.texts[i] if forced else out.texts[i]
            reused = turn == 0 and bool(s.segments) and llm.reuse_flow is not None
            layouts.append(prompt_layout(tok, s) if reused else None)
            prompts.append(layouts[-1].token_ids if reused else prompt_ids(tok, s, turn, history[:turn]))
            if forced:
                target = forced.tokens[i][turn]
                params.append(SamplingParams(max_tokens=len(target), forced_tokens=tuple(target),
                                             ignore_eos=True, keep_logits=True))
            else:
                params.append(SamplingParams(max_tokens=cfg.max_new_tokens or s.max_new_tokens, keep_logits=keep_logits))
        for ids, p in zip(prompts, params):
            check_fits(llm.engine, 1, len(ids), p.max_tokens)
        for layout in layouts:  # stage 1: cache-building requests store each segment on its own
            if layout is not None:
                llm.cache_segments(layout)
        seqs, reuse_stats = [], []
        try:  # interrupted (Ctrl-C, a stopped trial): its requests leave the engine idle
            for i, ids, p, layout in zip(rows, prompts, params, layouts):
                stored = reference.prompt(ids) if reference is not None and not record else None
                if stored is not None and layout is None and llm.engine.block_manager.num_free * llm.engine.kv.block_size > len(ids):
                    seqs.append(llm.add_prefilled(ids, p, (stored.k, stored.v), stored.logits))  # decode flows prefill densely
                elif layout is None:  # queued: the scheduler admits it when blocks are free
                    seqs.append(llm.engine.add_request(ids, p))
                else:  # stage 2: the measured request reuses them (prefilled by the scheduler with the rest)
                    seq, stats = llm.add_reuse_request(layout, p)
                    seqs.append(seq)
                    reuse_stats.append((i, stats))
            pending = list(seqs)
            unrecorded = [(q, ids) for q, ids, layout in zip(seqs, prompts, layouts)
                          if record and keep_logits and layout is None and reference.wants(ids)]
            while llm.engine.scheduler.has_work():
                llm.engine.step()
                if unrecorded:
                    unrecorded = [(q, ids) for q, ids in unrecorded if not _record_prompt(llm, q, ids, reference)]
                if tick is not None:
                    done = [q for q in pending if q.status == Status.FINISHED]
                    if done:
                        pending = [q for q in pending if q.status != Status.FINISHED]
                        tick(len(done))
        except BaseException:
            for q in seqs:
                llm.engine.abort(q)  # a finished one is left as it is
            raise
        for i, stats in reuse_stats:
            out.reuse[i] = stats.to_dict()
        for i, ids, s in zip(rows, prompts, seqs):
            out.prompts[i].append(ids)
            out.tokens[i].append(s.completion_ids)
            out.texts[i].append(tok.decode(s.completion_ids))
            out.logits[i].append(s.logits)
    return out


def _record_prompt(llm: LLM, seq: Sequence, ids: list[int], reference: DenseReference) -> bool:
    """Store a turn's prompt KV once it is prefilled; True when done with it (stored, or finished
    without its blocks)."""
    if seq.status == Status.FINISHED:
        return True
    kv = llm.prompt_kv(seq) if seq.logits else None
    if kv is None:
        return False
    reference.keep_prompt(ids, PromptKV(kv[0], kv[1], seq.logits[0]))
    return True


def _is_plain(llm: LLM) -> bool:
    """Full attention and no reuse: what the dense reference pass computes."""
    return llm.flow is None and (llm.reuse_flow is None or not llm.reuse_flow.reads_cache)


def _passes(plain: bool, dense_needed: bool, fidelity: bool) -> int:
    """Passes over each sample: the dense reference, the flow's own, the forced one (fidelity)."""
    return int(dense_needed) + int(not (plain and dense_needed)) + int(dense_needed and fidelity and not plain)


_PASS_FIELDS = ("texts", "tokens", "logits", "prompts", "reuse")


def _dense_pass(llm: LLM, chunk: list[Sample], cfg: EvalConfig, tick: Callable[[int], None],
                reference: DenseReference | None) -> _Pass:
    """The dense reference pass over a chunk: full attention, every prompt token computed (no
    reuse); taken from `reference` when it holds every sample of the chunk, else run and stored."""
    if reference is not None and all((s.task, s.index) in reference.samples for s in chunk):
        kept = [reference.samples[(s.task, s.index)] for s in chunk]
        tick(sum(len(s.turns) for s in chunk))
        return _Pass(*([k[name] for k in kept] for name in _PASS_FIELDS))
    setup = llm.setup
    llm.apply(setup.dense())
    try:
        dense = _run_pass(llm, chunk, cfg, keep_logits=cfg.fidelity, tick=tick, reference=reference,
                          record=reference is not None)
    finally:
        llm.apply(setup)
    if reference is not None:
        for i, s in enumerate(chunk):
            reference.samples[(s.task, s.index)] = {name: getattr(dense, name)[i] for name in _PASS_FIELDS}
    return dense


def _chunk_records(llm: LLM, chunk: list[Sample], cfg: EvalConfig, dense_needed: bool,
                   on_turns: Callable[[float], None] | None = None,
                   reference: DenseReference | None = None) -> list[dict[str, Any]]:
    """Records of a chunk of samples; `on_turns(fraction)`: the share of the chunk's work done."""
    plain = _is_plain(llm)
    units = _passes(plain, dense_needed, cfg.fidelity) * sum(len(s.turns) for s in chunk)
    state = {"done": 0}

    def tick(n: int) -> None:
        state["done"] += n
        if on_turns is not None:
            on_turns(min(1.0, state["done"] / units))

    dense = _dense_pass(llm, chunk, cfg, tick, reference) if dense_needed else None
    main = (dense if plain and dense is not None
            else _run_pass(llm, chunk, cfg, keep_logits=False, tick=tick, reference=reference))
    forced = (_run_pass(llm, chunk, cfg, True, forced=dense, tick=tick, reference=reference)
              if dense is not None and cfg.fidelity and not plain else None)
    records = []
    for i, s in enumerate(chunk):
        turn_scores = score_turns(s, main.texts[i])
        rec: dict[str, Any] = {
            "task": s.task, "index": s.index, "metric": s.metric,
            "answers": [list(t.answers) for t in s.turns],
            "prompt_sha256": [_ids_hash(p) for p in main.prompts[i]],
            "prompt_tokens": [len(p) for p in main.prompts[i]],
            "output": main.texts[i], "turn_scores": turn_scores, "score": sum(turn_scores) / len(turn_scores),
            "dense": None, "fidelity": None, "reuse": main.reuse[i], "meta": s.meta,
        }
        if dense is not None and not plain:
            ds = score_turns(s, dense.texts[i])
            rec["dense"] = {"output": dense.texts[i], "turn_scores": ds, "score": sum(ds) / len(ds)}
        if forced is not None:
            tally = FidelityTally()
            for f_logits, d_logits in zip(forced.logits[i], dense.logits[i]):
                tally.add(f_logits, d_logits)
            rec["fidelity"] = tally.to_record()
        records.append(rec)
    return records


# ---- results from records -------------------------------------------------------------------------

def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 6) if xs else None


def summarize(records: list[dict[str, Any]], totals: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-task and overall accuracy, dense accuracy and fidelity, from sample records alone;
    `totals`: how many samples each task has (`n` of `total` ran, after --limit)."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    tasks: dict[str, Any] = {}
    overall = FidelityTally()
    for name, recs in by_task.items():
        fid = FidelityTally()
        for r in recs:
            if r.get("fidelity"):
                fid.add_record(r["fidelity"])
                overall.add_record(r["fidelity"])
        dense = [r["dense"]["score"] for r in recs if r.get("dense")]
        tasks[name] = {
            "accuracy": _mean([r["score"] for r in recs]), "n": len(recs), "total": (totals or {}).get(name),
            "dense_accuracy": _mean(dense) if len(dense) == len(recs) else None,
            "fidelity": fid.summary(),
        }
    accuracy = _mean([t["accuracy"] for t in tasks.values()])
    dense_scores = [t["dense_accuracy"] for t in tasks.values()]
    dense_accuracy = _mean(dense_scores) if tasks and all(d is not None for d in dense_scores) else None  # type: ignore[arg-type]
    return {
        "accuracy": accuracy,
        "dense_accuracy": dense_accuracy,
        "relative_accuracy": round(accuracy / dense_accuracy, 6) if accuracy is not None and dense_accuracy else None,
        "tasks": tasks,
        "fidelity": overall.summary(),
    }


def summarize_reuse(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the samples prefilled by the reuse flow (stage 2 requests), and the median of their
    TTFT as `ReuseStats.seconds` has it: the scheduler step that prefilled each (its realign and the
    step's forward, which it shares with the requests packed into that step)."""
    stats = [r["reuse"] for r in records if r.get("reuse")]
    ttft = sorted(s["seconds"] for s in stats)
    return {
        "requests": len(stats),
        **{k: _mean([s[k] for s in stats]) for k in ("reuse_ratio", "recompute_ratio", "compute_fraction")},
        # Per-head and sparse-FFN flows (redknot): what their plans kept; older records lack them.
        **{k: _mean([s[k] for s in stats]) for k in ("mlp_fraction", "fresh_kv_fraction", "head_paged_kv_fraction")
           if stats and all(k in s for s in stats)},
        "ttft_p50_s": round(ttft[len(ttft) // 2], 6) if ttft else None,
    }


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The finished samples of a run (`records.read_lines`: a cut-off last line is redone)."""
    return read_lines(run_dir / "samples.jsonl")


# ---- the run --------------------------------------------------------------------------------------

def _check_samples_fit(llm: LLM, samples: list[Sample], cfg: EvalConfig) -> None:
    """Every sample's first prompt and reply fit one request (custom files are not resized),
    before a run directory exists."""
    for s in samples:
        ids = prompt_layout(llm.tokenizer, s).token_ids if s.segments else prompt_ids(llm.tokenizer, s, 0, [])
        from_file = "line" in s.meta  # a task file's sample: its prompt, not --context, is the fix
        try:
            check_fits(llm.engine, 1, len(ids), cfg.max_new_tokens or s.max_new_tokens, SAMPLE if from_file else EVAL)
        except SparsetuneError as e:
            where = f"{s.task} sample {s.index}" + (f" (line {s.meta['line']})" if from_file else "")
            raise SparsetuneError(f"{where}: {e}") from None


def _budget_note(llm: LLM, context: int) -> str | None:
    """Say so when a sparse flow attends every block of the context anyway: it then matches dense."""
    flow = llm.flow
    if flow is None or attended_tokens(llm.model_config, flow, context) < context:
        return None
    window = forced_only(llm.model_config, flow)  # sinks + recent window only (streaming)
    budget = f"{flow.budget_ratio:g} of the context" if flow.budget_ratio is not None else f"{flow.budget} tokens"
    what = f"its sink and local blocks ({flow.sink_blocks} + {flow.local_blocks})" if window else f"its budget ({budget})"
    fix = "lower --param local_blocks" if window else "pass --param budget_ratio=0.125 (or a smaller --param budget)"
    return (f"{flow.name} attends every block of the {context}-token context: {what} covers it, so the result "
            f"is dense attention; {fix}")


def evaluate(
    config: EvalConfig,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    llm: LLM | None = None,
    on_progress: ProgressFn | None = None,
    on_start: Callable[[Path, EvalResult], None] | None = None,
    on_chunk: Callable[[EvalResult], None] | None = None,
    reference: DenseReference | None = None,
) -> EvalResult:
    """Evaluate `config`; returns its `results.json` record (also written to the run directory under `out`).

    `resume`: the run directory of an interrupted run, with `config` its own (`load_resume_config`);
    finished samples are kept. `llm`: an idle engine of the config's model to reuse (sweeps): its
    flows are switched to the config's; engine options (device, dtype, batch limits, KV memory) are
    then the engine's own. `reference`: a `DenseReference` kept across evaluations of `llm` on the
    same prompts (a search's trials): the dense pass runs once and decode flows start from the
    stored prompt KV. `on_chunk(partial)`: the results so far after each chunk of samples (what
    results.json then holds), in process; raising stops the run there, results.json left partial.
    Everything is checked before an engine is built or a run directory is created.
    """
    check_config(config)
    if resume is None:
        cfg, run_dir = config, None
    else:
        cfg, run_dir = config, Path(resume)
        if cfg != load_resume_config(run_dir):
            raise SparsetuneError(f"--resume {run_dir}: the config differs from the run's config.json")
    from sparsetune.evaluation.tasks import DEFAULT_SUITE, build_samples, task_size

    task_names = list(cfg.tasks or DEFAULT_SUITE)
    e = cfg.setup.engine
    if llm is None:
        llm = LLM(run_engine_config(cfg))
    else:
        if cfg.batch > llm.config.max_num_seqs:
            raise SparsetuneError(f"--batch {cfg.batch} exceeds the engine's max_num_seqs {llm.config.max_num_seqs}")
        llm.apply(cfg.setup)  # refused when the setup is for another model
    resolved_mode = _resolve_mode(cfg, llm.device)
    accuracy_on = resolved_mode in ("accuracy", "all")
    speed_on = resolved_mode in ("speed", "all")
    if accuracy_on and llm.tokenizer is None:
        raise SparsetuneError(f"{llm.resolved.name} has no tokenizer; accuracy tasks need one (or pass --mode speed)")
    all_samples: list[Sample] = []
    task_totals: dict[str, int] = {}
    if accuracy_on:
        for name in task_names:
            built = build_samples(name, llm.tokenizer, cfg.context, cfg.samples, e.seed, cfg.limit)
            all_samples.extend(built)
            if built:
                task_totals[built[0].task] = task_size(name, cfg.samples)
        _check_samples_fit(llm, all_samples, cfg)
        if reference is not None:  # what determines the prompts and the dense answers
            reference.bind((llm.resolved.name, llm.resolved.random_weights, str(llm.dtype), tuple(task_names),
                            cfg.context, cfg.samples, e.seed, cfg.limit, cfg.max_new_tokens, cfg.fidelity))
    if speed_on:
        check_fits(llm.engine, cfg.batch, cfg.context, cfg.max_new_tokens or DEFAULT_SPEED_TOKENS)

    flow_name = llm.flow_name
    flow_params = llm.flow.params() if llm.flow is not None else {}
    tuned = None if cfg.setup.flow is None else cfg.setup.flow.tuned
    note = _budget_note(llm, cfg.context)
    if run_dir is None:
        # <flow>, <reuse flow> (dense decoding), or <flow>-<reuse flow>
        label = [flow_name] if llm.reuse_flow is None or flow_name != "dense" else []
        label += [llm.reuse_flow.name] if llm.reuse_flow is not None else []
        run_dir = new_run_dir(out, *label, llm.resolved.name)
        config_json = {
            "schema": CONFIG_SCHEMA, "eval": cfg.model_dump(mode="json"), "mode": resolved_mode, "tasks": task_names,
            "flow": {"name": flow_name, "spec": None if cfg.setup.flow is None else cfg.setup.flow.spec, "params": flow_params,
                     "source_sha256": None if cfg.setup.flow is None else cfg.setup.flow.source_sha256, "defaults": tuned},
            "reuse": None if llm.reuse_flow is None else {"name": llm.reuse_flow.name, "params": llm.reuse_flow.params()},
            "model": {"name": llm.resolved.name, "random_weights": llm.resolved.random_weights,
                      "config": asdict(llm.model_config) if hasattr(llm.model_config, "__dataclass_fields__") else None},
            "engine": {k: v for k, v in asdict(llm.config).items() if k not in ("extra",)},
            "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
        }
        write_json(run_dir / "config.json", config_json)
        write_json(run_dir / "env.json", env_info(llm.device))

    records = read_records(run_dir)
    done = {(r["task"], r["index"]) for r in records}
    todo = [s for s in all_samples if (s.task, s.index) not in done]
    prior = EvalResult.read(run_dir) if (run_dir / "results.json").is_file() else None
    state: dict[str, Any] = {"speed": prior.speed if prior else None, "started": prior.started if prior else _now(),
                             "t0": time.time(), "seconds_before": prior.seconds if prior else 0.0}

    def results(complete: bool) -> EvalResult:
        res: dict[str, Any] = {
            "schema": SCHEMA, "run_dir": str(run_dir), "flow": flow_name, "model": llm.resolved.name,
            "params": flow_params, "mode": resolved_mode, "context": cfg.context, "samples_per_task": cfg.samples,
            "limit": cfg.limit, "seed": e.seed, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
            "note": note,
        }
        if tuned:
            res["defaults"] = tuned
        if llm.reuse_flow is not None:
            res["reuse"] = {"flow": llm.reuse_flow.name, "params": llm.reuse_flow.params(), **summarize_reuse(records)}
        if accuracy_on:
            res |= summarize(records, task_totals)
            res["samples_done"] = len(records)
            res["samples_total"] = len(all_samples)
        else:
            res |= {"accuracy": None, "dense_accuracy": None, "relative_accuracy": None, "tasks": {}, "fidelity": None}
        res |= {"speed": state["speed"], "preemptions": llm.engine.scheduler.num_preemptions, "complete": complete,
                "started": state["started"], "finished": _now() if complete else None,
                "seconds": round(state["seconds_before"] + time.time() - state["t0"], 2)}
        return EvalResult.model_validate(res)

    if on_start is not None:
        on_start(run_dir, results(False))
    flow_is_dense = llm.flow is None
    dense_needed = accuracy_on and not _is_plain(llm) and cfg.fidelity
    total = len(all_samples) + (1 if speed_on else 0)
    chunk_size = cfg.batch if llm.device.type == "cpu" else 4 * cfg.batch
    try:
        if on_progress:
            on_progress(len(records), total, "samples")
        with open(run_dir / "samples.jsonl", "a") as f:
            for start in range(0, len(todo), chunk_size):
                chunk = todo[start:start + chunk_size]
                base = len(records)

                def partial(fraction: float, base: int = base, n: int = len(chunk)) -> None:
                    if on_progress:  # whole samples are counted once their records are written
                        on_progress(base + min(fraction, 0.99) * n, total, "samples")

                new = _chunk_records(llm, chunk, cfg, dense_needed, partial, reference)
                for r in new:
                    f.write(json.dumps(r, default=str) + "\n")
                f.flush()
                records.extend(new)
                so_far = results(False)
                so_far.write(run_dir / "results.json")
                if on_chunk:
                    on_chunk(so_far)
                if on_progress:
                    on_progress(len(records), total, "samples")
        if speed_on and state["speed"] is None:
            state["speed"] = _speed(llm, cfg, flow_is_dense)
            if on_progress:
                on_progress(total, total, "speed")
    except BaseException:
        results(False).write(run_dir / "results.json")
        raise
    final = results(True)
    final.write(run_dir / "results.json")
    return final


def _speed(llm: LLM, cfg: EvalConfig, flow_is_dense: bool) -> dict[str, Any]:
    gen = cfg.max_new_tokens or DEFAULT_SPEED_TOKENS
    seed = cfg.setup.engine.seed
    flow_speed = measure_speed(llm, cfg.batch, cfg.context, gen, seed)
    dense_speed = None
    if not flow_is_dense:
        setup = llm.setup
        llm.apply(replace(setup, flow=None))
        dense_speed = measure_speed(llm, cfg.batch, cfg.context, gen, seed)
        llm.apply(setup)
    speedup = None
    if dense_speed and flow_speed["decode_tokens_per_s"] and dense_speed["decode_tokens_per_s"]:
        speedup = round(flow_speed["decode_tokens_per_s"] / dense_speed["decode_tokens_per_s"], 4)
    return {"flow": flow_speed, "dense": dense_speed, "decode_speedup": speedup}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
