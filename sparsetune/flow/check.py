"""`flows check`: validate a flow before it runs, and estimate what it costs.

1. Static, on the file's source before it is imported (`source_check`): the stage methods
   call only flow ops (`F.name`), a few value builtins, or the flow's own helper methods (no
   torch, no imports); the file's top level and imports keep to the flow API.
2. Shapes: the stages run on small dummy tensors; every op checks its inputs and a failure
   names the flow file and line. Every cached field must be read by the indexer.
3. Cost: bytes of cached fields per selection unit, and indexer FLOPs per step (per KV head, per
   unit); a two-level flow's first level (`DecodeFlow.page_flow`) the same per block, beside.
4. Full budget equals dense attention on random paged KV.
"""

from __future__ import annotations

import inspect
import textwrap
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.ops import FT, Fields, FlowError, Selection
from sparsetune.flow.trace import OpRecord, tracing
from sparsetune.flow.shapes import dummy_inputs
from sparsetune.flow.source_check import class_stage_problems


@dataclass
class CheckReport:
    name: str
    path: str
    source: str
    params: dict[str, Any]
    fields: dict[str, list[int]] = field(default_factory=dict)
    field_bytes_per_block: int = 0  # per KV head, beside a bf16 pool (`DecodeFlow.field_itemsize`)
    indexer_flops_per_block: int = 0  # per KV head per decode step
    indexer_flops_fixed: int = 0
    ops: list[str] = field(default_factory=list)
    full_budget_rel_err: float | None = None
    compiled: dict[str, str] = field(default_factory=dict)  # stage -> how the compiled executor runs it on GPU
    # A two-level flow's first level, the same costs per whole block, with `units_per_block` and
    # `coarse` (blocks kept per budget): {fields, field_bytes_per_block, indexer_flops_per_block, ...}.
    page_level: dict[str, Any] | None = None
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def static_problems(cls: type[DecodeFlow]) -> list[str]:
    """Calls in the stage methods (and the helpers they call) that are not flow ops (file:line: message).

    The rule is `source_check`'s, on the class in its file's syntax tree; `loader.load_file`
    already ran it (with the other source rules) before the file was imported."""
    path = Path(inspect.getsourcefile(cls) or "?")
    if path.is_file():
        return class_stage_problems(path, cls.__name__)
    src_lines, first = inspect.getsourcelines(cls)  # no file: the class's own source, at its lines
    return class_stage_problems(path, cls.__name__, source="\n" * (first - 1) + textwrap.dedent("".join(src_lines)))


def _flow_line(cls: type[DecodeFlow], exc: BaseException) -> str:
    path = inspect.getsourcefile(cls)
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if fr.filename == path:
            return f"{path}:{fr.lineno}: "
    return f"{path}: "


def _run_stages(
    flow: DecodeFlow, head_dim: int, group: int, num_blocks: int, rows: int = 2
) -> tuple[dict, list[OpRecord], list[OpRecord], Fields]:
    """Run both stages on dummy inputs; the cache stage's output, each stage's op records, the fields."""
    x = dummy_inputs(flow, head_dim, rows)
    with tracing() as cache_trace:
        out = flow.run_cache(x.k, x.v, x.const)
    if not isinstance(out, dict) or not all(isinstance(t, FT) for t in out.values()):
        raise FlowError("cache() must return a dict of flow tensors, e.g. {'kmax': F.max(k, dim=1)}")
    for name, t in out.items():
        if t.shape[0] != 1:
            raise FlowError(f"cache() field {name!r} has shape {list(t.shape)}; reduce over the block's tokens (dim 1) so it is [1, r, c]")
    q, fields = x.index({n: t.shape[1:] for n, t in out.items()}, group, num_blocks)
    with tracing() as index_trace:
        sel = flow.run_index(q, fields, x.const)
    if not isinstance(sel, Selection):
        raise FlowError("index() must end in `return F.topk(score)` (or F.keep_only_forced())")
    if sel.score is not None and sel.score.shape != (num_blocks, 1, 1):
        raise FlowError(f"the score passed to F.topk has shape {list(sel.score.shape)}, expected [S, 1, 1]")
    return out, cache_trace.records, index_trace.records, fields


def check_flow(cls: type[DecodeFlow], raw_params: dict[str, str] | None = None, head_dim: int = 64,
               group: int = 4) -> CheckReport:
    """Run a decode flow class (`loader.get_flow_class(..., all_problems=True)` found it) on small
    inputs: its shapes, cost and compiled paths, and that it equals dense attention at full budget."""
    flow = cls.from_strings(raw_params or {})
    report = CheckReport(cls.name, str(getattr(cls, "path", "")), cls.source, flow.params())
    if cls.full_attention:
        return report
    cost = level_cost(flow, head_dim, group)
    report.fields, report.ops = cost.pop("fields"), cost.pop("ops")
    for k, v in cost.items():
        setattr(report, k, v)
    page = flow.page_flow()
    if page is not None:
        report.page_level = {**level_cost(page, head_dim, group), "units_per_block": flow.block_size // flow.unit,
                             "coarse": flow.coarse}
    report.compiled = compiled_paths(flow, head_dim, group, bool(report.fields))
    report.full_budget_rel_err = full_budget_error(cls, raw_params or {}, head_dim, group)
    report.ok = report.full_budget_rel_err < 1e-5
    if not report.ok:
        raise SparsetuneError(
            f"{cls.path}: at full budget the flow differs from dense attention (rel. err {report.full_budget_rel_err:.2e})"
        )
    return report


def level_cost(flow: DecodeFlow, head_dim: int, group: int) -> dict[str, Any]:
    """One level's stages on dummy inputs: its fields, their bytes per unit (beside a bf16 pool), the indexer's
    FLOPs per unit and fixed (per KV head per step) and the ops it calls."""
    cls = type(flow)
    try:
        out, cache_ops, index_small, fields = _run_stages(flow, head_dim, group, num_blocks=4)
        _, _, index_big, _ = _run_stages(flow, head_dim, group, num_blocks=8)
    except FlowError as e:
        raise SparsetuneError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a flow program can fail in any way; report where
        raise SparsetuneError(f"{_flow_line(cls, e)}{type(e).__name__}: {e}") from None
    unread = set(out) - fields.read
    if unread:
        stages = "cache_page() but never read by index_page()" if flow.level else "cache() but never read by index()"
        raise SparsetuneError(f"{getattr(cls, 'path', cls.name)}: field(s) {', '.join(sorted(unread))} written by {stages}")
    dims = {n: list(t.shape[1:]) for n, t in out.items()}
    # The indexer's FLOPs grow linearly with the units S: fit a + b*S from S = 4 and S = 8.
    f4 = sum(r.flops for r in index_small)
    per = max(0, (sum(r.flops for r in index_big) - f4) // 4)
    return {"fields": dims, "field_bytes_per_block": sum(flow.field_itemsize(2) * r * c for r, c in dims.values()),
            "indexer_flops_per_block": per, "indexer_flops_fixed": max(0, f4 - 4 * per),
            "ops": [r.op for r in cache_ops + index_small]}


def compiled_paths(flow: DecodeFlow, head_dim: int, group: int, has_fields: bool) -> dict[str, str]:
    """How the compiled executor runs each stage on GPU: a generated kernel, or why not."""
    from sparsetune.flow.compile import why_not

    why = why_not(flow, group, head_dim)
    paths = {s: "generated Triton kernel" if r is None else f"torch.compile ({r})" for s, r in why.items()}
    if not has_fields:
        paths["cache"] = "none (no fields)"
    return paths


def full_budget_error(cls: type[DecodeFlow], raw: dict[str, str], head_dim: int, group: int) -> float:
    """Max relative error of the flow at budget_ratio=1 against dense paged decode (float64)."""
    from sparsetune.engine.attention import AttentionMetadata
    from sparsetune.engine.kv_cache import KVCache
    from sparsetune.models.artifacts import synthetic_calibration
    from sparsetune.flow.attention import FlowAttention
    from sparsetune.kernels.paged_decode import paged_decode_attention_ref

    full = {"budget_ratio": "1.0", "select_layers": ""}  # one layer: it must select
    params = {**raw, **{k: v for k, v in full.items() if k not in cls.inapplicable}}
    flow = cls.from_strings(params)
    bs, hkv = flow.block_size, 2
    lens = [5 * bs + 3, 2 * bs, 1]
    nblk = [-(-n // bs) for n in lens]
    kv = KVCache(1, sum(nblk) + 4, hkv, bs, head_dim, torch.float64, "cpu")
    g = torch.Generator().manual_seed(1)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, dtype=torch.float64))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, dtype=torch.float64))
    perm = torch.randperm(kv.num_blocks, generator=g)
    tables, start = [], 0
    for n in nblk:
        tables.append(perm[start : start + n].tolist())
        start += n
    width = max(nblk)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # A calibrated flow is checked without a model: a synthetic channel order stands in.
    calibration = synthetic_calibration(1, hkv, head_dim) if flow.calibrated else None
    attn = FlowAttention(flow, head_dim**-0.5, calibration=calibration)
    for i, n in enumerate(lens):  # the cache stage (both levels') as a prefill that wrote all tokens runs it
        attn.rebuild_fields(0, kv, bt[i], n)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=g, dtype=torch.float64)
    meta = AttentionMetadata(False, torch.tensor([n - 1 for n in lens]), torch.zeros(len(lens), dtype=torch.long), bt,
                             torch.tensor(lens, dtype=torch.int32), lens, list(range(len(lens) + 1)), [0, 1, 2])
    out = attn.decode(0, q, kv, meta)
    ref = paged_decode_attention_ref(q, kv.k[0], kv.v[0], bt, meta.seq_lens, head_dim**-0.5)
    return ((out - ref).norm() / ref.norm()).item()
