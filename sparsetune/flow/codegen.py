"""Generate Triton kernels from a flow's stages: the compiled executor's fast path.

A stage is traced once on small dummy tensors (every `F.*` call is recorded, `trace.tracing`). If
every op is *block-local* (its output for block s depends only on block s: elementwise ops,
comparisons, `where`, `gemm`, reductions over the inner axes, `transpose`, `mask_slice`,
`fill`), the stage is rewritten as straight-line Triton code:

- **indexer** (`build_indexer`): one program owns `BLOCK_S` blocks of one (request, KV head)
  row. It loads the group's query heads once, each block's fields once through the block table
  (the group shares them; Inductor's fused reduction re-read them per query head), evaluates
  the program in fp32 registers and writes the row's masked score (always-kept blocks +inf,
  blocks past the sequence -inf, NaN → lowest) and the row's block count (budget) for the
  radix-select top-k (`sparsetune.kernels.select_topk`).
- **cache stage** (`build_cache`): one program per (block, KV head): load the block's keys and
  values, compute the fields, store them (to the null block when the block is not complete),
  replacing a gather, the Inductor kernels and an index_put per field.

Ops across blocks (softmax/normalize/reductions over dim 0, conv1d), `reshape`, and state
(`F.save`) are not block-local: such a flow keeps the Inductor path, and `why_not` says why.

Every value is a 3-D tensor `[S, a, b]` (S = BLOCK_S, or 1 for block-constant values such as
the query, constants, or anything in the cache stage); inner axes are padded to powers of two,
and reductions (including the contraction of `gemm`) mask the padding with their neutral
element, so padding never reaches a real value.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

from sparsetune.flow.base import BudgetRule, DecodeFlow
from sparsetune.flow.ops import FT
from sparsetune.flow.trace import GraphNode, dummy_inputs, field_dims, saves_state, tracing  # noqa: F401 (re-exported)

_ELEMS_PER_PROGRAM = 16384  # the largest intermediate of one program, in fp32 elements (4 warps)
_F32_MAX = "3.4028234663852886e38"
# The indexer's parameters that change no shape: the budget rule (`BudgetRule`, in its field order).
_RULE_PARAMS = ("SINK", "LOCAL", "RATIO: tl.float64", "FLOOR")


class NotBlockLocal(Exception):
    """The stage cannot become one block-local kernel; the message says which op and why."""


class ForcedOnly(NotBlockLocal):
    """The indexer scores nothing (`F.keep_only_forced`): the selection is arithmetic, no kernel."""


def _p2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class _Val:
    """A tile of generated code: `[S or 1, a, b]`, padded to powers of two."""

    name: str
    s: bool  # varies over blocks
    a: int
    b: int
    is_bool: bool = False

    def shape(self) -> str:
        return f"[{'BLOCK_S' if self.s else 1}, {_p2(self.a)}, {_p2(self.b)}]"


def _ptr_params(var: str, ndim: int) -> list[str]:
    """Kernel parameters of one tensor: its pointer and `ndim` strides (see `_with_strides`)."""
    return [f"{var}_ptr"] + [f"{var}_s{i}" for i in range(ndim)]


def _with_strides(t: torch.Tensor) -> list[object]:
    """Launch arguments of one tensor: itself and its strides (matching `_ptr_params`)."""
    return [t, *t.stride()]


def _const_loads(em: "_Emitter", const_dims: dict[str, tuple[int, int]]) -> tuple[list[str], list[str], list[str]]:
    """The constants a stage reads: their names, kernel parameters and tile loads (per KV head h)."""
    used = [n for n in const_dims if f"c_{n}" in em.used]
    params = [p for n in used for p in _ptr_params(f"c_{n}", 3)]
    loads = [_tile_load(f"c_{n}", f"c_{n}_ptr", f"h * c_{n}_s0", *const_dims[n], f"c_{n}_s1", f"c_{n}_s2", False)
             for n in used]
    return used, params, loads


def _tile_load(var: str, ptr: str, base: str, r: int, c: int, s2: str, s3: str, over_s: bool, extra: str = "") -> str:
    """`var = ` a `[S or 1, r, c]` fp32 tile at `ptr + base + i*s2 + j*s3` (`base` is a vector
    over the tile's blocks when `over_s`), padding read as 0."""
    ri, ci = f"tl.arange(0, {_p2(r)})", f"tl.arange(0, {_p2(c)})"
    base = f"({base})[:, None, None]" if over_s else base
    mask = f"({ri} < {r})[None, :, None] & ({ci} < {c})[None, None, :]{extra}"
    return (f"    {var} = tl.load({ptr} + {base} + {ri}[None, :, None] * {s2} + {ci}[None, None, :] * {s3},"
            f" mask={mask}, other=0.0).to(tl.float32)")


@dataclass
class _Emitter:
    """Turns recorded op nodes into Triton statements over named input tiles: each op's own
    emission (`ops.Op.emit`), given its tensor arguments as tiles and this emitter's helpers."""

    inputs: dict[int, tuple[str, bool]]  # id(FT) -> (variable, varies over blocks)
    vals: dict[int, _Val] = field(default_factory=dict)
    body: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    biggest: int = 1  # the largest per-block intermediate over blocks, in elements (sets BLOCK_S)

    p2 = staticmethod(_p2)

    def tensor(self, x: FT) -> _Val:
        """The tile of a flow tensor: a stage input or an earlier op's output."""
        if id(x) not in self.vals:
            if id(x) not in self.inputs:
                raise NotBlockLocal("a tensor comes from outside the flow op set")
            var, over_s = self.inputs[id(x)]
            self.used.add(var)
            self.vals[id(x)] = _Val(var, over_s, x.shape[1], x.shape[2])
        return self.vals[id(x)]

    def ref(self, x: _Val | float) -> str:
        """An operand: a tile's variable or a number's literal."""
        if isinstance(x, _Val):
            return x.name
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise NotBlockLocal(f"unsupported operand {x!r}")
        return self.lit(x)

    @staticmethod
    def lit(x: float) -> str:
        x = float(x)
        return repr(x) if math.isfinite(x) else f'float("{x}")'

    @staticmethod
    def axis_mask(axis: int, n: int) -> str:
        """Which indices along tile axis `axis` (1 or 2) are real, of `n`."""
        idx = ["None", "None", "None"]
        idx[axis] = ":"
        return f"(tl.arange(0, {_p2(n)}) < {n})[{', '.join(idx)}]"

    def stmt(self, line: str) -> None:
        """A statement placed before the op's own assignment."""
        self.body.append(f"    {line}")

    def grow(self, elems: int) -> None:
        """An intermediate of `elems` elements per block (BLOCK_S shrinks to fit)."""
        self.biggest = max(self.biggest, elems)

    @staticmethod
    def refuse(why: str) -> NoReturn:
        raise NotBlockLocal(why)

    def emit(self, nodes: list[GraphNode]) -> None:
        for node in nodes:
            op = node.op
            if op.emit is None:
                raise NotBlockLocal(f"F.{op.name} is not block-local: {op.not_local}")
            bound = inspect.signature(op.fn).bind(*node.args, **node.kwargs)
            bound.apply_defaults()
            args = {k: self.tensor(v) if isinstance(v, FT) else v for k, v in bound.arguments.items()}
            s = any(isinstance(v, _Val) and v.s for v in args.values())
            out = _Val(f"v{len(self.body)}", s, *node.out.shape[1:], node.out.data.dtype == torch.bool)
            code = op.emit(self, out, **args)
            if out.s:  # block-constant values (the query's own math) do not grow with BLOCK_S
                self.grow(_p2(out.a) * _p2(out.b))
            self.vals[id(node.out)] = out
            self.body.append(f"    {out.name} = {code}")


def _source(name: str, signature: list[str], lines: list[str], doc: str, runtime: tuple[str, ...] = ()) -> str:
    """A module holding one kernel; `runtime`: scalar parameters left unspecialized (one binary for every value)."""
    keep = f"(do_not_specialize={[p.split(':')[0] for p in runtime]!r})" if runtime else ""
    return "\n".join([f'"""{doc}"""', "import triton", "import triton.language as tl", "", "", f"@triton.jit{keep}",
                      f"def {name}({', '.join(signature)}):", *lines, ""])


# ---- indexer ----------------------------------------------------------------------------------


@dataclass
class IndexerKernel:
    """A generated indexer and what to pass it; `__call__` returns masked scores `[B*Hkv, W]`
    (fp32) and the number of blocks each row attends `[B*Hkv]` (int32)."""

    kernel: object
    fields: list[str]
    consts: list[str]
    uses_keys: bool
    block_s: int
    source: str

    def __call__(
        self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        stores: dict[str, torch.Tensor], k_pool: torch.Tensor | None, consts: dict[str, torch.Tensor],
        hkv: int, null_block: int, rule: BudgetRule,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, width = block_tables.shape
        rows = b * hkv
        out = torch.empty(rows, width, dtype=torch.float32, device=q.device)
        counts = torch.empty(rows, dtype=torch.int32, device=q.device)
        args: list[object] = [q, q.stride(0), q.stride(1), block_tables, block_tables.stride(0), seq_lens,
                              out, out.stride(0), counts, width, hkv, null_block, *rule]
        args += [a for name in self.fields for a in _with_strides(stores[name])]
        if self.uses_keys:
            assert k_pool is not None
            args += [k_pool, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)]
        args += [a for name in self.consts for a in _with_strides(consts[name])]
        grid = (rows, -(-width // self.block_s))
        self.kernel[grid](*args, BLOCK_S=self.block_s, num_warps=4)  # type: ignore[index]
        return out, counts


def indexer_source(
    flow: DecodeFlow, group: int, head_dim: int, field_dims: dict[str, tuple[int, int]],
    const_dims: dict[str, tuple[int, int]] | None = None,
) -> tuple[str, list[str], list[str], bool, int]:
    """Triton source of the flow's indexer; raises NotBlockLocal. Returns (source, fields and
    consts in argument order, whether it reads raw keys, BLOCK_S)."""
    bs = flow.block_size
    x = dummy_inputs(flow, head_dim, const_dims=const_dims)
    q, fields = x.index(field_dims, group)
    const = x.const
    inputs = {id(q): ("q_in", False)}
    inputs.update({id(dict.__getitem__(fields, n)): (f"f_{n}", True) for n in field_dims})
    if flow.uses_keys:
        inputs[id(dict.__getitem__(fields, "k"))] = ("k_in", True)
    inputs.update({id(t): (f"c_{n}", False) for n, t in const.items()})
    with tracing() as t:
        sel = flow.run_index(q, fields, const)
    nodes = t.nodes
    if fields.saved:
        raise NotBlockLocal("it saves state (F.save)")
    if sel.score is None:
        raise ForcedOnly("it selects no scored blocks (keep_only_forced)")
    em = _Emitter(inputs)
    em.emit(nodes)
    sv = em.tensor(sel.score)
    if sv.is_bool:
        raise NotBlockLocal("the score is boolean")
    score = sv.name if sv.s else f"({sv.name} + tl.zeros([BLOCK_S, 1, 1], tl.float32))"
    block_s = max(1, min(64, _ELEMS_PER_PROGRAM // em.biggest))
    block_s = 1 << (block_s.bit_length() - 1)

    sig = ["q", "stride_qb", "stride_qh", "bt", "stride_bt", "seq_lens", "out", "stride_o", "counts", "W", "HKV", "NULL",
           *_RULE_PARAMS]
    loads = [_tile_load("q_in", "q", f"b * stride_qb + h * {group} * stride_qh", group, head_dim, "stride_qh", "1", False)]
    fields_used = [n for n in field_dims if f"f_{n}" in em.used]
    for n in fields_used:
        sig += _ptr_params(f"f_{n}", 4)
        loads.append(_tile_load(f"f_{n}", f"f_{n}_ptr", f"phys * f_{n}_s0 + h * f_{n}_s1", *field_dims[n],
                                f"f_{n}_s2", f"f_{n}_s3", True))
    uses_keys = "k_in" in em.used
    if uses_keys:
        sig += ["k_ptr", "k_s0", "k_s1", "k_s2"]
        live = f" & ((j[:, None, None] * {bs} + tl.arange(0, {_p2(bs)})[None, :, None]) < seq_len)"
        loads.append(_tile_load("k_in", "k_ptr", "phys * k_s0 + h * k_s1", bs, head_dim, "k_s2", "1", True, live))
    consts_used, const_params, const_loads = _const_loads(em, const_dims or {})
    sig += const_params
    loads += const_loads
    lines = [
        "    row = tl.program_id(0)",
        "    b = row // HKV",
        "    h = row % HKV",
        "    j = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)",
        "    seq_len = tl.load(seq_lens + b)",
        f"    nb = (seq_len + {bs - 1}) // {bs}",
        "    live = j < nb",
        "    phys = tl.load(bt + b * stride_bt + j, mask=live, other=NULL).to(tl.int64)",
        *loads,
        *em.body,
        f"    sc = tl.reshape({score}, (BLOCK_S,))",
        f"    sc = tl.where(sc != sc, -{_F32_MAX}, sc)",
        f"    sc = tl.minimum(tl.maximum(sc, -{_F32_MAX}), {_F32_MAX})",
        "    sc = tl.where((j < SINK) | (j >= nb - LOCAL), float('inf'), sc)",
        "    sc = tl.where(live, sc, float('-inf'))",
        "    tl.store(out + row * stride_o + j, sc, mask=j < W)",
        *(f"    {line}" for line in BudgetRule.TRITON),
        "    tl.store(counts + row, want, mask=tl.program_id(1) == 0)",
    ]
    doc = f"Generated by sparsetune.flow.codegen: the indexer of flow {flow.name!r} (group {group}, head_dim {head_dim})."
    src = _source("flow_indexer", sig + ["BLOCK_S: tl.constexpr"], lines, doc, _RULE_PARAMS)
    return src, fields_used, consts_used, uses_keys, block_s


def build_indexer(
    flow: DecodeFlow, group: int, head_dim: int, field_dims: dict[str, tuple[int, int]],
    const_dims: dict[str, tuple[int, int]] | None = None,
) -> IndexerKernel:
    """The generated indexer for this flow and shapes (raises NotBlockLocal)."""
    src, fields, consts, uses_keys, block_s = indexer_source(flow, group, head_dim, field_dims, const_dims)
    return IndexerKernel(_load_kernel(src, "flow_indexer"), fields, consts, uses_keys, block_s, src)


# ---- cache stage ------------------------------------------------------------------------------


@dataclass
class CacheKernel:
    """A generated cache stage: fields of blocks `src` (one per request) written to blocks `dst`."""

    kernel: object
    fields: list[str]
    consts: list[str]
    source: str

    def __call__(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
        stores: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
    ) -> None:
        self._launch(k_pool, v_pool, src, dst, None, None, 0, stores, consts)

    def decode(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, null_block: int, stores: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
    ) -> None:
        """A decode step: each request's block holding `positions[i]`, stored only if that token
        completes it (else to the null block): no index arithmetic outside the kernel."""
        self._launch(k_pool, v_pool, positions, positions, block_tables, seq_lens, null_block, stores, consts)

    def _launch(self, k_pool, v_pool, src, dst, block_tables, seq_lens, null_block, stores, consts) -> None:
        hkv = k_pool.shape[1]
        from_pos = block_tables is not None
        bt = block_tables if from_pos else src
        args: list[object] = [k_pool, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                              v_pool, v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), src, dst, hkv,
                              bt, bt.stride(0), seq_lens if from_pos else src, null_block]
        args += [a for name in self.fields for a in _with_strides(stores[name])]
        args += [a for name in self.consts for a in _with_strides(consts[name])]
        self.kernel[(src.numel() * hkv,)](*args, FROM_POSITIONS=from_pos, num_warps=4)  # type: ignore[index]


def cache_source(
    flow: DecodeFlow, head_dim: int, const_dims: dict[str, tuple[int, int]] | None = None
) -> tuple[str, list[str], list[str]]:
    """Triton source of the flow's cache stage; raises NotBlockLocal. Returns (source, fields in
    argument order, consts in argument order)."""
    bs = flow.block_size
    x = dummy_inputs(flow, head_dim, const_dims=const_dims)
    k, v, const = x.k, x.v, x.const
    inputs = {id(k): ("k_in", False), id(v): ("v_in", False)}
    inputs.update({id(t): (f"c_{n}", False) for n, t in const.items()})
    with tracing() as t:
        out = flow.run_cache(k, v, const)
    nodes = t.nodes
    em = _Emitter(inputs)
    em.emit(nodes)
    sig = ["k_ptr", "k_s0", "k_s1", "k_s2", "v_ptr", "v_s0", "v_s1", "v_s2", "src", "dst", "HKV", "bt", "stride_bt",
           "seq_lens", "NULL"]
    loads = [_tile_load(f"{x}_in", f"{x}_ptr", f"blk * {x}_s0 + h * {x}_s1", bs, head_dim, f"{x}_s2", "1", False)
             for x in ("k", "v") if f"{x}_in" in em.used]
    consts_used, const_params, const_loads = _const_loads(em, const_dims or {})
    loads += const_loads
    stores: list[str] = []
    names = list(out)
    for n in names:
        val = em.tensor(out[n])
        r, c = out[n].shape[1:]
        ri, ci = f"tl.arange(0, {_p2(r)})", f"tl.arange(0, {_p2(c)})"
        stores.append(
            f"    tl.store(f_{n}_ptr + dst_blk * f_{n}_s0 + h * f_{n}_s1 + {ri}[None, :, None] * f_{n}_s2"
            f" + {ci}[None, None, :] * f_{n}_s3, {val.name},"
            f" mask=({ri} < {r})[None, :, None] & ({ci} < {c})[None, None, :])"
        )
    sig += [p for n in names for p in _ptr_params(f"f_{n}", 4)] + const_params
    lines = ["    row = tl.program_id(0)", "    i = row // HKV", "    h = row % HKV",
             "    if FROM_POSITIONS:",  # decode: src holds each request's new position
             "        pos = tl.load(src + i)",
             f"        blk = tl.load(bt + i * stride_bt + pos // {bs}).to(tl.int64)",
             f"        done = (pos % {bs} == {bs - 1}) & (tl.load(seq_lens + i) > 0)",
             "        dst_blk = tl.where(done, blk, NULL).to(tl.int64)",
             "    else:",
             "        blk = tl.load(src + i).to(tl.int64)",
             "        dst_blk = tl.load(dst + i).to(tl.int64)",
             *loads, *em.body, *stores]
    doc = f"Generated by sparsetune.flow.codegen: the cache stage of flow {flow.name!r} (head_dim {head_dim})."
    return _source("flow_cache", sig + ["FROM_POSITIONS: tl.constexpr"], lines, doc), names, consts_used


def build_cache(flow: DecodeFlow, head_dim: int, const_dims: dict[str, tuple[int, int]] | None = None) -> CacheKernel:
    src, fields, consts = cache_source(flow, head_dim, const_dims)
    return CacheKernel(_load_kernel(src, "flow_cache"), fields, consts, src)


# ---- loading and reporting ----------------------------------------------------------------------

_LOADED: dict[str, object] = {}


def _load_kernel(src: str, fn_name: str) -> object:
    """Triton reads a kernel's source from its file: write it once per content hash, import it."""
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    if key not in _LOADED:
        d = Path(tempfile.gettempdir()) / f"sparsetune-kernels-{os.getuid()}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{fn_name}_{key}.py"
        if not path.exists() or path.read_text() != src:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(src)
            tmp.replace(path)
        name = f"sparsetune_generated_{fn_name}_{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED[key] = getattr(module, fn_name)
    return _LOADED[key]


def why_not(flow: DecodeFlow, group: int = 4, head_dim: int = 64,
            const_dims: dict[str, tuple[int, int]] | None = None) -> dict[str, str | None]:
    """For each stage: None if it becomes a generated kernel, else the reason it does not."""
    dims = field_dims(flow, head_dim, const_dims)
    reasons: dict[str, str | None] = {}
    for stage, make in (("cache", lambda: cache_source(flow, head_dim, const_dims)),
                        ("index", lambda: indexer_source(flow, group, head_dim, dims, const_dims))):
        try:
            make()
            reasons[stage] = None
        except NotBlockLocal as e:
            reasons[stage] = str(e)
    return reasons
