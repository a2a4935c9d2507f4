"""Where one decode step's time goes: attention, each flow stage, GEMMs, norms, sampling, ...

`profile_decode(llm, batch, context)` prefills `batch` random-token prompts of `context` tokens for
real (so a flow's cache-stage fields exist), times a few engine decode steps (CUDA graphs on GPU),
then profiles one more decode step eagerly with `torch.profiler` and attributes its time to
`CATEGORIES`:

- on GPU, kernel time (CUDA activity): each kernel (memcpy, memset) goes to the category of the
  CPU-side launch call with its correlation id, which sits in the event tree under the op or
  stage range that launched it (Triton kernels too); a kernel whose launch is not in the profiled
  step falls back to its name (`KERNEL_CATEGORIES`; `by_kernel_name_ms` says how much did);
- on CPU, CPU time: each op's self time goes to its category; coarser, since a CPU "kernel" is an
  aten op and time between ops (Python, scheduling) counts too.

An op's category is its innermost stage range (`sparsetune.engine.ranges.stage`: attention,
indexer, top-k, KV store, the flow's cache stage, norm, RoPE, activation, sampling), else its
name (`OP_CATEGORIES`: GEMMs, greedy sampling's argmax, ...), else "other" (embedding, input
preparation, scheduling, the logits' cast). On CPU the categories partition the profiled step's
time; on GPU they sum the kernel time, which is below the eager step's wall time by the gaps
between launches.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd import DeviceType

from sparsetune.engine.ranges import PREFIX, stage_ranges
from sparsetune.setup import Setup
from sparsetune.errors import SparsetuneError
from sparsetune.perf.admission import PROFILE, check_fits, check_positions
from sparsetune.perf.timing import sync, time_call, time_calls

# Display order; keys of `result["categories"]`.
CATEGORIES = ("attention", "indexer", "topk", "cache_update", "gemm", "norm", "rope", "activation", "sampling", "other")
LABELS = {"topk": "top-k", "cache_update": "cache update"}

# Stage range (engine/ranges.py) → (category, part of the category).
STAGES = {
    "attention": ("attention", None),
    "indexer": ("indexer", None),
    "topk": ("topk", None),
    "kv_store": ("cache_update", "kv store"),
    "realign": ("cache_update", "realign"),  # a reuse request's segments copied in, keys rotated
    "cache_stage": ("cache_update", "flow cache stage"),
    "norm": ("norm", None),
    "rope": ("rope", None),
    "activation": ("activation", None),
    "sampling": ("sampling", None),
}

# Ops outside every stage range, by name (first match of an op or its enclosing ops).
OP_CATEGORIES = (
    ("gemm", ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", "aten::baddbmm")),
    ("sampling", ("aten::argmax", "aten::multinomial", "aten::softmax", "aten::sort", "aten::cumsum")),
    ("topk", ("aten::topk",)),
)

# GPU kernels that no profiled CPU op claims, by (lower-cased) kernel name; first match wins.
KERNEL_CATEGORIES = (
    ("attention", ("paged_decode", "merge_splits", "cudnn", "fmha", "flash", "attention", "sdpa")),
    ("topk", ("topk", "radix", "bitonic")),  # torch.topk, and sparsetune's _select_topk_kernel
    ("indexer", ("flow_indexer",)),
    ("cache_update", ("flow_cache", "store_kv")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "sm90", "cublas", "matmul", "nvjet")),
    ("norm", ("rms_norm",)),
    ("rope", ("rope",)),
    ("activation", ("silu",)),
    ("sampling", ("argmax",)),
)

_ROOT = "sparsetune profile: step"
WARMUP = 2  # decode steps before timing


def _by_name(name: str, table) -> str | None:
    low = name.lower()
    return next((cat for cat, keys in table if any(k in low for k in keys)), None)


class _Attribution:
    """Category (and part) of each CPU event under the profiled root, memoised."""

    def __init__(self, root) -> None:
        self.root = root
        self.memo: dict[int, tuple[str, str | None]] = {}  # by object: ops and launch calls' ids may clash

    def __call__(self, ev) -> tuple[str, str | None]:
        got = self.memo.get(id(ev))
        if got is None:
            got = self.memo[id(ev)] = self._find(ev)
        return got

    def _find(self, ev) -> tuple[str, str | None]:
        node = ev
        while node is not None and node is not self.root:  # innermost stage range
            if node.name.startswith(PREFIX):
                found = STAGES.get(node.name[len(PREFIX):])
                if found:
                    return found
            node = node.cpu_parent
        node = ev
        while node is not None and node is not self.root:  # else the op's name, or an enclosing op's
            cat = _by_name(node.name, OP_CATEGORIES)
            if cat:
                return cat, None
            node = node.cpu_parent
        return "other", None


def _descendants(root) -> list:
    out, todo = [], list(root.cpu_children)
    while todo:
        ev = todo.pop()
        out.append(ev)
        todo.extend(ev.cpu_children)
    return out


def _annotation(ev) -> bool:
    """A record_function range mirrored on the GPU timeline (it spans kernels; it is none)."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(PREFIX) or ev.name == _ROOT


def breakdown(prof, cuda: bool) -> dict[str, Any]:
    """Time per category of the profiled step (the `_ROOT` range) in ms: CUDA kernel time when
    `cuda`, else CPU self time. Returns {"categories": {cat: {"ms", "top", "parts"?}}, "sum_ms"}."""
    events = prof.events()
    root = next((e for e in events if e.name == _ROOT), None)
    if root is None:
        raise RuntimeError("the profile has no step range")
    attr = _Attribution(root)
    ms: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    top: dict[str, dict[str, float]] = {}

    def add(cat: str, part: str | None, name: str, us: float) -> None:
        ms[cat] = ms.get(cat, 0.0) + us / 1e3
        if part is not None:
            parts.setdefault(cat, {})[part] = parts.setdefault(cat, {}).get(part, 0.0) + us / 1e3
        top.setdefault(cat, {})[name] = top.setdefault(cat, {}).get(name, 0.0) + us / 1e3

    members = [root] + _descendants(root)
    if cuda:
        # A kernel (or memcpy/memset) and the CPU-side runtime/driver call that launched it share a
        # correlation id; the call sits in the CPU event tree under the op or stage range that made
        # it (Triton kernels included, which the profiler does not link to an op).
        launches = {ev.id: ev for ev in members if ev.device_type == DeviceType.CPU and ev.name.startswith("cu")}
        unclaimed = 0.0
        for ev in events:
            if ev.device_type != DeviceType.CUDA or _annotation(ev):
                continue
            us = ev.time_range.elapsed_us()
            launch = launches.get(ev.id)
            cat, part = attr(launch) if launch is not None else ("other", None)
            if cat == "other":  # launched outside every stage and known op, or unmatched: the name may say
                cat = _by_name(ev.name, KERNEL_CATEGORIES) or "other"
            if launch is None:
                unclaimed += us / 1e3
            add(cat, part, ev.name, us)
    else:
        for ev in members:
            if ev is root:
                add("other", None, "host (Python, scheduling)", ev.self_cpu_time_total)
                continue
            cat, part = attr(ev)
            # A stage range's own time is host code between its ops (Python, dispatch).
            name = f"host (Python) in {ev.name[len(PREFIX):]}" if ev.name.startswith(PREFIX) else ev.name
            add(cat, part, name, ev.self_cpu_time_total)
    total = sum(ms.values())
    cats: dict[str, Any] = {}
    for cat in CATEGORIES:
        if cat not in ms:
            continue  # nothing of the step fell in it (e.g. indexer and top-k of a dense step)
        entry: dict[str, Any] = {"ms": round(ms[cat], 4), "percent": round(100 * ms[cat] / total, 2) if total else 0.0}
        if cat in parts:
            entry["parts"] = {p: round(v, 4) for p, v in sorted(parts[cat].items(), key=lambda kv: -kv[1])}
        entry["top"] = {n: round(v, 4) for n, v in sorted(top[cat].items(), key=lambda kv: -kv[1])[:5]}
        cats[cat] = entry
    out: dict[str, Any] = {"categories": cats, "sum_ms": round(total, 4)}
    if cuda:
        out["by_kernel_name_ms"] = round(unclaimed, 4)  # kernels no CPU op claimed: categorised by name
    return out


@contextmanager
def _without_kineto_notes():
    """The profiler's native library writes `USDT:` start/stop notes straight to file descriptor 2;
    keep every other line (warnings, errors) on stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                sys.stderr.buffer.write(b"".join(kept))
                sys.stderr.flush()


def profile_call(fn: Callable[[], Any], device: torch.device | str, trace_path: str | Path | None = None) -> dict[str, Any]:
    """Profile one call of `fn` (eager code: no CUDA graph replays) with the stage ranges on.
    Returns `breakdown(...)` plus "wall_ms" (the profiled call, profiler overhead included) and
    "timing" (what the milliseconds measure)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with warnings.catch_warnings():  # torch's note about scheduled cycles: this profile has none
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        with _without_kineto_notes(), stage_ranges(), profile(activities=activities) as prof:
            with record_function(_ROOT):
                wall = time_call(fn, device)
        if trace_path is not None:
            _write_trace(prof, Path(trace_path))
        out = breakdown(prof, cuda)
    out["wall_ms"] = round(wall * 1e3, 4)
    out["timing"] = "GPU kernel time" if cuda else "CPU time"
    return out


def _write_trace(prof, path: Path) -> None:
    """The profiled call's Chrome trace at `path`. The profiler writes it in its own code, which says
    nothing when it cannot: it writes into a fresh temporary folder, and the file is moved into place
    here, where a failure is an error naming the path."""
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / path.name  # the same suffix: .gz is written compressed
        prof.export_chrome_trace(str(staged))
        if not staged.is_file():
            raise SparsetuneError(f"--trace {path}: the profiler wrote no trace (its temporary folder {tmp} may be "
                                  "full); set TMPDIR to a folder with room")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(staged, path)
        except OSError as e:
            raise SparsetuneError(f"--trace {path}: cannot write the trace there ({e.strerror or e}); "
                                  "pick another --trace") from None


def decode_tokens_needed(steps: int, warmup: int) -> int:
    """Tokens each sequence generates in `profile_decode` (prefill's token, warm-up, timed engine
    steps, timed eager steps, the profiled step and its warm-up)."""
    return 1 + warmup + 2 * steps + 3


def _check_case(batch: int, context: int, steps: int) -> None:
    if batch < 1:
        raise SparsetuneError(f"--batch must be at least 1 (got {batch})")
    if context < 1:
        raise SparsetuneError(f"--context must be at least 1 token (got {context})")
    if steps < 1:
        raise SparsetuneError(f"--steps must be at least 1 (got {steps})")


def profile_decode(
    llm, batch: int, context: int, trace_path: str | Path | None = None, steps: int = 5, warmup: int = WARMUP,
    seed: int = 0,
) -> dict[str, Any]:
    """Break one decode step of `batch` sequences at `context` tokens into categories.

    Prefills `batch` random-token prompts (seeded) through the engine, runs `warmup` decode steps,
    times `steps` engine steps (`step_ms`: median; CUDA graphs where the engine uses them) and
    `steps` eager ones (`eager_step_ms`), then profiles one eager decode step (runner + sampling +
    scheduling; `trace_path`: also write its Chrome trace). The engine must be idle; it is idle
    again afterwards (the sequences are dropped)."""
    from sparsetune.engine.sequence import SamplingParams, Status

    _check_case(batch, context, steps)
    if warmup < 0:
        raise SparsetuneError(f"warm-up steps must be >= 0 (got {warmup})")
    if llm.engine.scheduler.has_work():
        raise RuntimeError("profile_decode needs an idle engine")
    if batch > llm.config.max_num_seqs:
        raise SparsetuneError(f"--batch {batch} exceeds the engine's max_num_seqs ({llm.config.max_num_seqs}); "
                              "build the engine with max_num_seqs >= batch")
    new = decode_tokens_needed(steps, warmup)
    check_fits(llm.engine, batch, context, new, PROFILE)

    vocab = llm.model_config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=new + 1, ignore_eos=True)  # greedy, never finishes early
    seqs = [llm.engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(), params) for _ in range(batch)]
    graphs = llm.engine.uses_graphs
    try:
        while any(s.status == Status.WAITING for s in seqs):  # real prefill, chunked as the engine does
            llm.engine.step()
        engine = time_calls(llm.engine.step, llm.device, steps, warmup)
        with llm.engine.eager_mode():  # profiled kernels, not a graph replay
            if graphs:  # an eager warm-up first (a compiled flow stage may compile for this batch shape)
                eager = time_calls(llm.engine.step, llm.device, steps, warmup=1)
            else:
                eager = engine
            with stage_ranges():
                llm.engine.step()  # warm-up with the ranges on
            if any(s.status != Status.RUNNING for s in seqs):
                raise RuntimeError("a profiled sequence finished early")
            prof = profile_call(llm.engine.step, llm.device, trace_path)
    finally:
        for s in seqs:
            llm.engine.abort(s)

    backends = [b for b in llm.engine.backends if getattr(b, "flow", None) is not None]
    flow = llm.flow
    paths: dict[str, str] = {}
    if backends:
        b = backends[0]  # one FlowAttention serves every sparse layer
        if b.executor == "reference":
            paths = {"index": "reference (torch, op by op)", "cache": "reference (torch, op by op)"}
        else:  # on GPU `b.paths` says which stages run generated kernels
            paths = {"index": "torch.compile (top-k inside the indexer's graph)", "cache": "torch.compile"}
        paths.update(b.paths)
    return {
        "model": llm.resolved.name,
        "flow": llm.flow_name,
        "flow_params": flow.params() if flow else {},
        "executor": backends[0].executor if backends else None,
        "paths": paths,
        "sparse_layers": sum(1 for b in llm.engine.backends if getattr(b, "flow", None) is not None),
        "layers": len(llm.engine.backends),
        "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "random_weights": llm.resolved.random_weights,
        "batch": batch,
        "context": context,
        "steps": steps,
        "timing": prof["timing"],
        "categories": prof["categories"],
        "sum_ms": prof["sum_ms"],
        **({"by_kernel_name_ms": prof["by_kernel_name_ms"]} if "by_kernel_name_ms" in prof else {}),
        "profiled_step_ms": prof["wall_ms"],
        "step_ms": round(statistics.median(engine) * 1e3, 4),
        "eager_step_ms": round(statistics.median(eager) * 1e3, 4),
        "cuda_graphs": graphs,
        "trace": None if trace_path is None else str(trace_path),
    }


def profile(setup: Setup, batch: int = 1, context: int = 2048, steps: int = 5,
            trace_path: str | Path | None = None) -> dict[str, Any]:
    """Build an engine from `setup`, sized for the case (max_num_seqs = batch, context + the decode
    steps, one graph for the batch unless the config lists sizes), and run `profile_decode` on it."""
    from sparsetune.llm import LLM
    from sparsetune.models.registry import REGISTRY

    _check_case(batch, context, steps)
    new = decode_tokens_needed(steps, WARMUP)
    engine = setup.engine
    spec = REGISTRY.get(engine.model.lower())
    if spec is not None:  # fail before loading
        check_positions(spec.name, spec.config.max_position_embeddings, context, new, PROFILE)
    cfg = replace(engine, max_num_seqs=batch, max_model_len=context + new,
                  cuda_graph_batch_sizes=engine.cuda_graph_batch_sizes or (batch,))
    llm = LLM(replace(setup, engine=cfg))
    return profile_decode(llm, batch, context, trace_path=trace_path, steps=steps, warmup=WARMUP, seed=engine.seed)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """A horizontal bar chart of ms per category (PNG, matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cats = result["categories"]
    names = [LABELS.get(c, c) for c in cats]
    values = [v["ms"] for v in cats.values()]
    fig = Figure(figsize=(8, 1.4 + 0.42 * len(names)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars = ax.barh(names, values, color="#4c72b0")
    ax.invert_yaxis()
    for bar, v in zip(bars, values):
        pct = 100 * v / result["sum_ms"] if result["sum_ms"] else 0.0
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.3g} ms ({pct:.0f}%)", va="center", fontsize=8)
    ax.set_xlim(0, max(values + [1e-9]) * 1.3)
    ax.set_xlabel(f"ms per decode step ({result['timing']})")
    ax.set_title(
        f"{result['model']} / {result['flow']}: batch {result['batch']}, context {result['context']} on "
        f"{result['device']}\nstep {result['step_ms']:.2f} ms (median of {result['steps']}"
        f"{', CUDA graphs' if result['cuda_graphs'] else ''}), categories sum {result['sum_ms']:.2f} ms",
        fontsize=9,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path
