"""What one trial measures, on engines a worker keeps for the whole search.

`EngineEvaluator` holds the accuracy engine (the search's model; block-size changes lay its KV
pool out anew, the weights stay) with a `DenseReference` per prompt set, so dense runs once per
prompt set and each trial decodes only; and, for measured speed, a second engine of the speed
model (random weights when it is another architecture) at the speed batch and context.

- accuracy: `evaluate` (the evaluation `sparsetune eval` runs) on the search set, relative to
  dense on the same prompts, with fidelity beside it; each trial's run folder is kept.
- memory: both engines stay on the GPU while they fit together. An out-of-memory failure (a KV pool
  or a prefill's activations) while both are held makes them take turns for the rest of the search:
  the failed step runs again with the other engine dropped, and from then on each engine is built
  when its step comes and the other dropped (a long accuracy context beside a 16 x 32K speed shape
  does not fit on one H200).
- speed: of the same point on the speed model (`flow.base.on_head_dim`: a calibrated flow's
  label channels keep their share of the head there; the speed info has the params it ran with
  where they differ). Measured: decode speedup over dense (median step times, side by side on one
  engine). Modeled: dense step time over the flow's, each modeled from what the step does with
  per-operation costs measured on a GPU (`perf.cost`; the speed info names the GPU and the
  fields' memory share).
  Reuse flows: measured, time to first token of full recompute over the flow's on a prompt whose
  90% is reused segments (`perf.speed.reuse_ttft_seconds`, the speed model at the speed context);
  modeled, a full prefill's token-layers over the flow's, as its evaluation counted them (so a
  reuse trial's modeled speed comes after its accuracy).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from sparsetune.errors import SparsetuneError
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.policy import failure_reason
from sparsetune.tuning.protocols import ChunkFn, EventFn, Hopeless

T = TypeVar("T")
REUSE_SPEED_REPEATS = 5  # timed requests of full recompute and of the flow, alternately


@dataclass
class Accuracy:
    relative: float | None  # flow accuracy / dense accuracy on the same prompts
    accuracy: float | None
    dense_accuracy: float | None
    samples: int
    fidelity: dict[str, Any] | None
    run_dir: str | None
    complete: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"relative_accuracy": self.relative, "accuracy": self.accuracy, "dense_accuracy": self.dense_accuracy,
                "samples": self.samples, "fidelity": self.fidelity, "run_dir": self.run_dir, "complete": self.complete,
                **self.extra}


def accuracy_from_dict(d: dict[str, Any]) -> Accuracy:
    """`Accuracy.to_dict`'s inverse (figures that crossed a process boundary)."""
    keys = ("relative_accuracy", "accuracy", "dense_accuracy", "samples", "fidelity", "run_dir", "complete")
    return Accuracy(*(d.get(k) for k in keys[:3]), int(d.get("samples") or 0), d.get("fidelity"), d.get("run_dir"),
                    bool(d.get("complete")), {k: v for k, v in d.items() if k not in keys})


def accuracy_of(result: dict[str, Any]) -> Accuracy:
    """The figures a trial keeps of an eval's results.json object."""
    return Accuracy(result.get("relative_accuracy"), result.get("accuracy"), result.get("dense_accuracy"),
                    int(result.get("samples_done") or 0), result.get("fidelity"), result.get("run_dir"),
                    bool(result.get("complete")),
                    {"tasks": {k: v.get("accuracy") for k, v in (result.get("tasks") or {}).items()},
                     "note": result.get("note"), **({"reuse": result["reuse"]} if result.get("reuse") else {})})


class EngineEvaluator:
    """Accuracy and speed of flows on engines kept for the whole search (one per worker)."""

    def __init__(self, cfg: SearchConfig, on_event: EventFn | None = None) -> None:
        from sparsetune.evaluation.reference import DenseReference

        self.cfg = cfg
        self.on_event = on_event  # ("turns", {"reason"}) once the engines start taking turns
        self._llm = None
        self._speed_llm = None
        self.take_turns = False  # the engines did not fit together: one at a time (module docstring)
        self._dense_step: dict[int, float] = {}  # block size -> dense step seconds on the speed engine
        self._reuse_prompt: list | None = None  # reuse speed: the prompt, its segments stored
        self.references: dict[tuple[int, int], DenseReference] = {}  # (samples, seed) -> reference

    # ---- engines ---------------------------------------------------------------------------------

    @property
    def llm(self):
        if self.take_turns:
            self._drop("_speed_llm")
        if self._llm is None:
            from sparsetune.device import resolve_device
            from sparsetune.evaluation.runner import eval_kv_memory, graph_batch_sizes
            from sparsetune.llm import LLM

            cfg = self.cfg
            chunk = cfg.batch * (4 if resolve_device(cfg.device).type == "cuda" else 1)  # an eval's chunk
            kv = eval_kv_memory(cfg.model, chunk, cfg.context, 512, cfg.device, cfg.dtype)
            self._llm = LLM(model=cfg.model, device=cfg.device, dtype=cfg.dtype, max_num_seqs=cfg.batch, defaults="published",
                            kv_memory=2 * kv, seed=cfg.seed,  # room for the fields of small blocks
                            cuda_graph_batch_sizes=graph_batch_sizes(cfg.batch))
        return self._llm

    def _speed_engine(self):
        if self.take_turns:
            self._drop("_llm")
        if self._speed_llm is None:
            from sparsetune.perf.speed import speed_engine

            model, random, batch, context = self.cfg.speed_shape()
            if self.cfg.kind == "reuse":  # one request: its prompt, the stored segments (90% as many tokens, each
                batch, context = 1, 3 * context  # in blocks of its own), and the room a pool needs to keep them
            self._speed_llm = speed_engine(model, random, batch, context, self.cfg.device, self.cfg.seed)
            self._reuse_prompt = None  # its segments are stored on the engine they were stored on only
        return self._speed_llm

    def _drop(self, name: str) -> None:
        """Let go of an engine (`_llm` or `_speed_llm`) and give its memory back to the device."""
        if getattr(self, name) is None:
            return
        from sparsetune.device import release_memory

        setattr(self, name, None)
        release_memory()

    def _retrying(self, step: Callable[[], T], other: str) -> T:
        """`step()`, run once more where it ran out of memory while the `other` engine (`_llm` or
        `_speed_llm`) was held too: from then on the engines take turns (module docstring)."""
        import torch

        from sparsetune.errors import OutOfMemory

        try:
            return step()
        except (torch.OutOfMemoryError, OutOfMemory) as e:
            if self.take_turns or getattr(self, other) is None:
                raise
            reason = failure_reason(e)
        # Out of the except block: the failed step's frames, and the tensors they held, are gone
        self.take_turns = True
        if self.on_event is not None:
            self.on_event("turns", {"reason": reason})
        for reference in self.references.values():
            reference.to_host()
        self._drop(other)
        return step()

    # ---- objectives ------------------------------------------------------------------------------

    def speed_after_accuracy(self) -> bool:
        """A reuse flow's modeled speed is what its evaluation computed: it comes after accuracy."""
        return self.cfg.kind == "reuse" and self.cfg.speed_kind() == "modeled"

    def speedup(self, flow: str, params: dict[str, str], accuracy: Accuracy | None = None) -> tuple[float, dict[str, Any]]:
        """Speedup over dense (decode) or full recompute (reuse) and how it was taken; a reuse
        flow's modeled speed reads `accuracy` (`speed_after_accuracy`)."""
        if self.cfg.kind == "reuse":
            return self._retrying(lambda: self._reuse_speedup(flow, params, accuracy), "_llm")
        from sparsetune.flow.base import on_head_dim
        from sparsetune.models.resolve import model_config
        from sparsetune.perf.cost import Costs, field_memory_share, kv_share, modeled_speedup
        from sparsetune.setup import lookup_flow_class

        model, random, batch, context = self.cfg.speed_shape()
        cls = lookup_flow_class(flow)
        built = cls.from_strings(params)  # the point as the trial ran it (published defaults)
        acc_cfg, speed_cfg = model_config(self.cfg.model, True)[1], model_config(model, random)[1]
        # the budget on the search's model and context (report.budget_shares): recorded here, where the flow runs
        share = round(kv_share(acc_cfg, built, self.cfg.context), 4)
        info: dict[str, Any] = {"model": model, "random_weights": random, "batch": batch, "context": context,
                                "kv_share": share}
        on_speed = on_head_dim(built, params, acc_cfg.head_dim, speed_cfg.head_dim)  # the same point there
        if on_speed != params:
            info["params"] = on_speed
        if self.cfg.speed_kind() == "modeled":
            costs = Costs.load()
            there = cls.from_strings(on_speed)
            value = modeled_speedup(speed_cfg, there, batch, context, costs)
            return round(value, 4), {"kind": "modeled", "what": costs.describe(), "costs": costs.gpu,
                                     "field_memory_share": round(field_memory_share(speed_cfg, there), 4), **info}
        llm, flow_s, dense_s = self._retrying(lambda: self._step_seconds(flow, on_speed, batch, context), "_llm")
        return round(dense_s / flow_s, 4), {"kind": "measured", "device": str(llm.device), "flow_step_ms": round(1e3 * flow_s, 4),
                                             "dense_step_ms": round(1e3 * dense_s, 4), **info}

    def _step_seconds(self, flow: str, params: dict[str, str], batch: int, context: int):
        """(the speed engine, the flow's decode step seconds, dense's at the flow's block size)."""
        from sparsetune.perf.speed import decode_step_seconds

        llm = self._speed_engine()
        try:
            llm.apply(llm.setup.with_flow(flow, params, defaults="published"))
        except BaseException:
            if not llm.engine.has_pool:  # its pool could not be laid out again: a new engine next time
                self._speed_llm = None
            raise
        flow_s = decode_step_seconds(llm, batch, context)
        bs = llm.engine.kv.block_size
        if bs not in self._dense_step:
            llm.apply(llm.setup.dense())
            self._dense_step[bs] = decode_step_seconds(llm, batch, context)
        return llm, flow_s, self._dense_step[bs]

    def _reuse_speedup(self, flow: str, params: dict[str, str], accuracy: Accuracy | None) -> tuple[float, dict[str, Any]]:
        model, random, _batch, context = self.cfg.speed_shape()
        if self.cfg.speed_kind() == "modeled":
            stats = (accuracy.extra.get("reuse") if accuracy is not None else None) or {}
            fraction = stats.get("compute_fraction")
            if not fraction:
                raise SparsetuneError(f"{flow}: its evaluation counted no reuse prefill (no prompt with segments)")
            return round(1 / fraction, 4), {"kind": "modeled", "what": "full prefill token-layers / the flow's",
                                            "compute_fraction": fraction, "model": self.cfg.model, "context": self.cfg.context}
        from sparsetune.perf.speed import reuse_prompt, reuse_ttft_seconds, store_segments

        llm = self._speed_engine()
        runs: dict[str, list[float]] = {"full_recompute": [], flow: []}
        try:
            if self._reuse_prompt is None:  # set once its segments are stored
                prompt = reuse_prompt(context, seed=self.cfg.seed, tokenizer=llm.tokenizer)
                store_segments(llm, prompt)
                self._reuse_prompt = prompt
            # Side by side: each warmed up, then full recompute and the flow alternately, medians of each
            setups = (("full_recompute", None), (flow, params))
            for name, p in setups:
                llm.use_reuse(name, p)
                reuse_ttft_seconds(llm, self._reuse_prompt, repeats=1, warmup=0)  # its warm-up
            for _ in range(REUSE_SPEED_REPEATS):
                for name, p in setups:
                    llm.use_reuse(name, p)
                    ttft, stats = reuse_ttft_seconds(llm, self._reuse_prompt, repeats=1, warmup=0)
                    runs[name].append(ttft)
        except BaseException:
            _drain(llm)
            raise
        full, ttft = statistics.median(runs["full_recompute"]), statistics.median(runs[flow])
        return round(full / ttft, 4), {
            "kind": "measured", "what": "full recompute TTFT / the flow's (medians, measured alternately)",
            "device": str(llm.device), "flow_ttft_ms": round(1e3 * ttft, 3), "full_ttft_ms": round(1e3 * full, 3),
            "flow_ttft_runs_ms": [round(1e3 * t, 3) for t in runs[flow]],
            "full_ttft_runs_ms": [round(1e3 * t, 3) for t in runs["full_recompute"]],
            "compute_fraction": stats.get("compute_fraction"), "prompt_tokens": stats.get("prompt_tokens"),
            "segment_hits": stats.get("segment_hits"), "model": model, "random_weights": random, "context": context}

    def eval_config(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int):
        """The evaluation of a trial's point: its setup is exactly the point (published defaults under
        its params); a reuse flow decodes with dense or its own decode flow."""
        from sparsetune.evaluation.config import EvalConfig

        cfg = self.cfg
        flows = (dict(flow=flow or "dense", params=params) if cfg.kind == "decode" else
                 dict(flow=None, reuse=flow, reuse_params=params))
        return EvalConfig.of(model=cfg.model, **flows, tasks=cfg.tasks, context=cfg.context, samples=samples,
                             batch=cfg.batch, seed=seed, mode="accuracy", device=cfg.device, dtype=cfg.dtype,
                             defaults="published")

    def accuracy(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int, out: Path,
                 on_chunk: ChunkFn | None = None) -> Accuracy:
        """`evaluate` of the flow on the prompt set (`samples` per task, `seed`), relative to dense;
        `on_chunk(partial results)` after each chunk but the last, as the evaluation hands them over
        (raising `Hopeless` stops it: the partial figures come back, `complete` False)."""
        return self._retrying(lambda: self._accuracy(flow, params, samples=samples, seed=seed, out=out, on_chunk=on_chunk),
                              "_speed_llm")

    def _accuracy(self, flow: str | None, params: dict[str, str], *, samples: int, seed: int, out: Path,
                  on_chunk: ChunkFn | None) -> Accuracy:
        from sparsetune.evaluation.reference import DenseReference
        from sparsetune.evaluation.results import EvalResult
        from sparsetune.evaluation.runner import evaluate

        ecfg = self.eval_config(flow, params, samples=samples, seed=seed)
        reference = self.references.setdefault((samples, seed), DenseReference())
        if self.take_turns:
            reference.to_host()
        so_far: list[EvalResult] = []  # the partial results the evaluation handed over last

        def chunk(partial: EvalResult) -> None:
            so_far[:] = [partial]
            if on_chunk is not None and (partial.samples_done or 0) < (partial.samples_total or 0):
                on_chunk(partial.dump())

        llm = self.llm
        if not llm.engine.has_pool:  # a relayout that left no pool: a new engine
            self._llm = None
            llm = self.llm
        try:
            result = evaluate(ecfg, out=out, llm=llm, reference=reference, on_chunk=chunk)
        except Hopeless:  # the cascade stopped it after a chunk: the figures up to there
            result = so_far[-1]
        except BaseException:
            _drain(llm)
            raise
        acc = accuracy_of(result.dump())
        acc.extra["setup"] = ecfg.setup.to_dict()  # the point as one value: what eval, export and serve read back
        return acc


def _drain(llm) -> None:
    """Drop every request an interrupted evaluation left, so the engine is idle for the next trial."""
    for seq in list(llm.engine.scheduler.waiting) + list(llm.engine.scheduler.running):
        llm.engine.abort(seq)
    if llm.engine.scheduler.has_work():
        raise SparsetuneError("the engine could not be drained after a failed trial")
