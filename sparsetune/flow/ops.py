"""The flow op set. Flow programs call only these (as `F.name(...)`).

A program sees logical, batch-1 tensors of rank 3, `[S, a, b]`: S is the block axis (the
sequence's KV blocks in the indexer; 1 in the cache stage, which sees one block at a time),
`a, b` are per-block inner axes. An axis of size 1 broadcasts. The framework stores each
tensor as `[R, S, a, b]`, R = (requests x KV heads) rows, with S padded to the longest
sequence and a `[R, S]` validity mask: reductions and softmax over the block axis ignore
padding, and top-k never selects it. So a program written for one sequence and one KV head
runs unchanged over a whole batch.

Each op is one `Op` record: its torch semantics on those row-batched tensors (the reference),
its cost, and its Triton emission for the kernel generator (`flow.compile`), or why it has none.
"""

from __future__ import annotations

import builtins
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sparsetune.flow.trace import active, caller_line
from sparsetune.flow.values import FT, Fields, FlowError, Selection  # noqa: F401 - part of the F namespace

NEG = float("-inf")


@dataclass(eq=False)
class Op:
    """One flow op, defined once.

    - `fn`: its torch semantics on row-batched flow tensors (what the reference executor runs);
    - `flops`: its cost per row from the call's arguments (None: one per output element);
    - `emit(e, out, **args)`: the Triton expression of its output tile `out`, the call's flow
      tensors given as tiles and other arguments as passed (`e`, the emitter: operand literals,
      tile helpers, statements placed before, `e.refuse(why)` where this call is not block-local);
      None when the op never is, and `not_local` says why.
    Calling it runs `fn`, names the flow line on a misuse, and records the call while tracing."""

    name: str
    fn: Callable[..., FT]
    emit: Callable[..., str] | None = None
    flops: Callable[..., int] | None = None
    not_local: str = ""

    def __post_init__(self) -> None:
        functools.update_wrapper(self, self.fn)  # F.gemm's docstring and signature are gemm's
        self.__name__ = self.__qualname__ = self.name

    def __call__(self, *args: Any, **kwargs: Any) -> FT:
        for a in args:
            if isinstance(a, torch.Tensor):
                raise FlowError(_where() + f"F.{self.name} got a raw torch tensor; flows use flow tensors only")
        try:
            out = self.fn(*args, **kwargs)
        except FlowError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise FlowError(_where() + f"F.{self.name}{_shapes(args)}: {e}") from None
        tracer = active()
        if tracer is not None:
            tracer.record(self, args, kwargs, out, self.flops(*args, **kwargs) if self.flops else math.prod(out.shape))
        return out


def _op(emit: Callable[..., str] | None = None, flops: Callable[..., int] | None = None, not_local: str = ""):
    """Decorator: the function is the op's torch semantics (see `Op`)."""
    return lambda fn: Op(fn.__name__, fn, emit, flops, not_local)


def _where() -> str:
    loc = caller_line()
    return f"{loc[0]}:{loc[1]}: " if loc else ""


def _shapes(args) -> str:
    return "(" + ", ".join(repr(a) if isinstance(a, FT) else repr(a) for a in args) + ")"


def _merge_mask(*ts: FT) -> torch.Tensor | None:
    masks = [t.mask for t in ts if t.mask is not None]
    if not masks:
        return None
    m = masks[0]
    for other in masks[1:]:
        m = m & other
    return m


def _check_rank3(*ts) -> None:
    for t in ts:
        if not isinstance(t, FT):
            raise TypeError(f"expected a flow tensor, got {type(t).__name__}")


# ---- elementwise ------------------------------------------------------------------------------


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x, y) -> FT:
    if isinstance(y, (int, float)):
        _check_rank3(x)
        return FT(fn(x.data, torch.tensor(y, dtype=x.data.dtype, device=x.data.device)), x.mask)
    _check_rank3(x, y)
    return FT(fn(x.data, y.data), _merge_mask(x, y))


def _binary_op(name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], triton: str) -> Op:
    """An elementwise op of two operands (`y` may be a number); `triton` formats `{x}`, `{y}`."""

    def op(x: FT, y: FT | float) -> FT:
        return _binary(fn, x, y)

    return Op(name, op, lambda e, out, x, y: triton.format(x=e.ref(x), y=e.ref(y)))


add = _binary_op("add", torch.add, "({x} + {y})")
sub = _binary_op("sub", torch.sub, "({x} - {y})")
mul = _binary_op("mul", torch.mul, "({x} * {y})")
div = _binary_op("div", torch.div, "({x} / {y})")
maximum = _binary_op("maximum", torch.maximum, "tl.maximum({x}, {y})")
minimum = _binary_op("minimum", torch.minimum, "tl.minimum({x}, {y})")


@_op(lambda e, out, x, alpha, beta: f"({x.name} * {e.lit(alpha)} + {e.lit(beta)})")
def scale(x: FT, alpha: float = 1.0, beta: float = 0.0) -> FT:
    """alpha * x + beta."""
    _check_rank3(x)
    return FT(x.data * alpha + beta, x.mask)


def _unary(name: str, fn: Callable[[torch.Tensor], torch.Tensor], triton: str) -> Op:
    """An elementwise op of one tensor; `triton` formats `{x}`."""

    def op(x: FT) -> FT:
        _check_rank3(x)
        return FT(fn(x.data), x.mask)

    return Op(name, op, lambda e, out, x: triton.format(x=x.name))


abs = _unary("abs", torch.abs, "tl.abs({x})")  # noqa: A001
exp = _unary("exp", torch.exp, "tl.exp({x})")
log = _unary("log", torch.log, "tl.log({x})")
relu = _unary("relu", torch.relu, "tl.maximum({x}, 0.0)")
sigmoid = _unary("sigmoid", torch.sigmoid, "tl.sigmoid({x})")
silu = _unary("silu", torch.nn.functional.silu, "({x} * tl.sigmoid({x}))")


# ---- comparisons: boolean flow tensors for `where` ----------------------------------------------

gt = _binary_op("gt", torch.gt, "({x} > {y})")
ge = _binary_op("ge", torch.ge, "({x} >= {y})")
lt = _binary_op("lt", torch.lt, "({x} < {y})")
le = _binary_op("le", torch.le, "({x} <= {y})")


@_op(lambda e, out, cond, x, y: f"tl.where({cond.name}, {e.ref(x)}, {e.ref(y)})")
def where(cond: FT, x: FT | float, y: FT | float) -> FT:
    _check_rank3(cond)
    if cond.data.dtype != torch.bool:
        raise TypeError("the condition must come from F.gt/ge/lt/le")
    xs = x.data if isinstance(x, FT) else torch.tensor(x)
    ys = y.data if isinstance(y, FT) else torch.tensor(y)
    others = [t for t in (x, y) if isinstance(t, FT)]
    return FT(torch.where(cond.data, xs, ys), _merge_mask(cond, *others))


# ---- products -----------------------------------------------------------------------------------


def _gemm_flops(x: FT, y: FT) -> int:
    s = builtins.max(x.shape[0], y.shape[0])  # this module's `max` is the flow op
    return 2 * s * x.shape[1] * y.shape[1] * x.shape[2]


def _emit_gemm(e, out, x, y) -> str:
    k = x.b
    kmask = f"(tl.arange(0, {e.p2(k)}) < {k})"
    if x.a == 1 or y.a == 1:
        # A matrix-vector product (e.g. one centroid against the query group): stay 3-D,
        # [S, m or n, k] -> sum over k; 4-D tiles cost Triton layout conversions. Over stage
        # inputs, a tensor-core form beside it (`dot_matvec`, which sizes its own tiles).
        prod = f"({x.name} * {y.name})"
        if e.p2(k) != k:
            prod = f"tl.where({kmask}[None, None, :], {prod}, 0.0)"
        code = f"tl.expand_dims(tl.sum({prod}, axis=2), {1 if x.a == 1 else 2})"
        dot = e.dot_matvec(out, x, y, code) if out.s else None
        if out.s and dot is None:  # the product tile, [S, m or n, k]
            e.grow(e.p2(builtins.max(x.a, y.a)) * e.p2(k))
        return dot or code
    if out.s:  # the product tile, [S, max(m, n), k]
        e.grow(e.p2(builtins.max(x.a, y.a)) * e.p2(k))
    # A matrix product: a static loop over the rows of the operand with fewer of them, each a 3-D
    # multiply-reduce placed into its output column (or row). 4-D tiles [S, m, n, k] would be
    # simpler and spill registers.
    e.stmt(f"{out.name} = tl.zeros({out.shape()}, tl.float32)")
    loop, other, axis = (y, x, 2) if y.a <= x.a else (x, y, 1)
    sel = f"(tl.arange(0, {e.p2(loop.a)}) == i)"
    put = f"{sel}[None, None, :]" if axis == 2 else f"{sel}[None, :, None]"
    prod = f"({other.name} * tl.sum(tl.where({sel}[None, :, None], {loop.name}, 0.0), axis=1)[:, None, :])"
    if e.p2(k) != k:
        prod = f"tl.where({kmask}[None, None, :], {prod}, 0.0)"
    part = f"tl.expand_dims(tl.sum({prod}, axis=2), {axis})"
    e.stmt(f"for i in tl.static_range({loop.a}):")
    e.stmt(f"    {out.name} += tl.where({put}, {part}, 0.0)")
    return out.name


@_op(_emit_gemm, _gemm_flops)
def gemm(x: FT, y: FT) -> FT:
    """`[S, m, k] x [S, n, k] -> [S, m, n]` (x @ yᵀ per block; S broadcasts)."""
    _check_rank3(x, y)
    if x.shape[2] != y.shape[2]:
        raise ValueError(f"inner dims differ: {x.shape[2]} vs {y.shape[2]}")
    (r, sx, m, k), (sy, n) = x.data.shape, y.shape[:2]
    # One side constant over blocks (e.g. the query): fold the block axis into the other side's
    # rows, so each row is one real GEMM instead of S tiny ones.
    if sy == 1 and sx > 1:
        out = torch.matmul(x.data.reshape(r, sx * m, k), y.data[:, 0].transpose(-1, -2)).view(r, sx, m, n)
    elif sx == 1 and sy > 1:
        out = torch.matmul(x.data[:, 0], y.data.reshape(r, sy * n, k).transpose(-1, -2))
        out = out.view(r, m, sy, n).transpose(1, 2)
    else:
        out = torch.matmul(x.data, y.data.transpose(-1, -2))
    return FT(out, _merge_mask(x, y))


# ---- reductions (keepdim) -----------------------------------------------------------------------


# Reductions: the neutral element (what padding reads as) and the Triton reduction.
_REDUCTIONS = {"sum": (0.0, "tl.sum"), "mean": (0.0, "tl.sum"), "l2norm": (0.0, "tl.sum"),
               "max": (NEG, "tl.max"), "min": (float("inf"), "tl.min")}


def _reduce(x: FT, dim: int, how: str) -> FT:
    _check_rank3(x)
    if dim not in (0, 1, 2):
        raise ValueError(f"dim must be 0 (blocks), 1 or 2, got {dim}")
    d = dim + 1  # skip the row axis
    data = x.data
    if dim == 0 and x.mask is not None:
        data = data.masked_fill(~x.mask.view(*x.mask.shape, 1, 1), _REDUCTIONS[how][0])
    if how == "sum":
        out = data.sum(d, keepdim=True)
    elif how == "mean":
        out = data.sum(d, keepdim=True)
        n = x.mask.sum(1).view(-1, 1, 1, 1).clamp(min=1) if dim == 0 and x.mask is not None else data.shape[d]
        out = out / n
    elif how == "max":
        out = data.amax(d, keepdim=True)
    elif how == "min":
        out = data.amin(d, keepdim=True)
    else:
        out = data.square().sum(d, keepdim=True).sqrt()
    return FT(out, None if dim == 0 else x.mask)


def _reduce_op(name: str) -> Op:
    """A reduction along `dim` (keepdim; 0 = over blocks, padding excluded)."""
    neutral, triton = _REDUCTIONS[name]

    def op(x: FT, dim: int) -> FT:
        return _reduce(x, dim, name)

    def emit(e, out, x, dim) -> str:
        if dim == 0:
            e.refuse(f"F.{name}(dim=0) reduces across blocks")
        n = (x.a, x.b)[dim - 1]
        src = f"({x.name} * {x.name})" if name == "l2norm" else x.name
        if e.p2(n) != n:  # padding of the reduced axis reads as the neutral element
            src = f"tl.where({e.axis_mask(dim, n)}, {src}, {e.lit(neutral)})"
        code = f"tl.expand_dims({triton}({src}, axis={dim}), {dim})"
        return {"mean": f"({code} / {n})", "l2norm": f"tl.sqrt({code})"}.get(name, code)

    return Op(name, op, emit)


sum = _reduce_op("sum")  # noqa: A001 - the flow op set's own names (F.sum, F.max, ...)
mean = _reduce_op("mean")
max = _reduce_op("max")  # noqa: A001
min = _reduce_op("min")  # noqa: A001
l2norm = _reduce_op("l2norm")


@_op(not_local="a normalization along an axis (dim 0: across blocks) has no tile emission")
def softmax(x: FT, dim: int, scale: float = 1.0) -> FT:
    """softmax(scale * x) along `dim` (0 = over blocks, padding excluded)."""
    _check_rank3(x)
    data = x.data.float() * scale
    if dim == 0 and x.mask is not None:
        data = data.masked_fill(~x.mask.view(*x.mask.shape, 1, 1), NEG)
    out = torch.softmax(data, dim=dim + 1).nan_to_num(0.0)
    return FT(out.to(x.data.dtype), x.mask)


@_op(not_local="a normalization along an axis (dim 0: across blocks) has no tile emission")
def normalize(x: FT, dim: int) -> FT:
    """x / sum(x) along `dim`."""
    s = _reduce(x, dim, "sum")
    return FT(x.data / s.data.clamp(min=1e-30), x.mask)


@_op(not_local="a stencil over neighbouring blocks")
def conv1d(x: FT, weight: tuple[float, ...]) -> FT:
    """Same-padded 1-D stencil along the block axis (e.g. pooling of neighbouring scores)."""
    _check_rank3(x)
    w = torch.tensor(weight, dtype=x.data.dtype, device=x.data.device)
    k = w.numel()
    data = x.data if x.mask is None else x.data.masked_fill(~x.mask.view(*x.mask.shape, 1, 1), 0.0)
    r, s, a, b = data.shape
    flat = data.permute(0, 2, 3, 1).reshape(r * a * b, 1, s)
    out = torch.nn.functional.conv1d(flat, w.view(1, 1, k), padding=k // 2)[..., :s]
    return FT(out.reshape(r, a, b, s).permute(0, 3, 1, 2).contiguous(), x.mask)


# ---- layout -------------------------------------------------------------------------------------


@_op(lambda e, out, x: f"tl.permute({x.name}, (0, 2, 1))", flops=lambda x: 0)
def transpose(x: FT) -> FT:
    """Swap the two inner axes."""
    _check_rank3(x)
    return FT(x.data.transpose(-1, -2), x.mask)


@_op(flops=lambda x, a, b: 0, not_local="reshaping a tile's inner axes has no tile emission")
def reshape(x: FT, a: int, b: int) -> FT:
    """Reshape the inner axes to `[a, b]`."""
    _check_rank3(x)
    r, s = x.data.shape[:2]
    return FT(x.data.reshape(r, s, a, b), x.mask)


def _emit_mask_slice(e, out, x, start, end, dim, inside, outside) -> str:
    idx = ["None", "None", "None"]
    idx[dim] = ":"
    ar = f"tl.arange(0, {e.p2((x.a, x.b)[dim - 1])})"
    hit = f"({ar} >= {int(start)}) & ({ar} < {int(end)})"
    return (f"(tl.where({hit}, {e.lit(inside)}, {e.lit(outside)})[{', '.join(idx)}]"
            f" + tl.zeros({out.shape()}, tl.float32))")


@_op(_emit_mask_slice)
def mask_slice(x: FT, start: int, end: int, dim: int, inside: float = 1.0, outside: float = 0.0) -> FT:
    """A positional constant shaped like x: `inside` for indices [start, end) along `dim` (1 or 2)."""
    _check_rank3(x)
    if dim not in (1, 2):
        raise ValueError("mask_slice works on the inner axes (dim 1 or 2)")
    idx = torch.arange(x.data.shape[dim + 1], device=x.data.device)
    inside_mask = (idx >= start) & (idx < end)
    shape = [1, 1, 1, 1]
    shape[dim + 1] = -1
    vals = torch.where(inside_mask, inside, outside).to(x.data.dtype).view(shape)
    return FT(vals.expand_as(x.data).contiguous(), x.mask)


@_op(lambda e, out, x, value: f"tl.full({out.shape()}, {e.lit(value)}, tl.float32)")
def fill(x: FT, value: float) -> FT:
    """A constant shaped like x."""
    _check_rank3(x)
    return FT(torch.full_like(x.data, value), x.mask)


# ---- selection ----------------------------------------------------------------------------------


def save(fields: Fields, name: str, value: FT) -> None:
    """Store `value` (shaped like the field) into field `name` for the next step (Save)."""
    if not isinstance(fields, Fields) or name not in fields or name == "k":
        raise FlowError(_where() + f"F.save: {name!r} is not a field written by cache()")
    if not isinstance(value, FT) or value.shape != dict.__getitem__(fields, name).shape:
        got = list(value.shape) if isinstance(value, FT) else type(value).__name__
        raise FlowError(_where() + f"F.save({name!r}): value {got} must have the field's shape "
                        f"{list(dict.__getitem__(fields, name).shape)}")
    fields.saved[name] = value


def topk(score: FT) -> Selection:
    """Exact top-k over blocks by `score` `[S, 1, 1]`; k comes from the flow's budget."""
    if not isinstance(score, FT):
        raise FlowError(_where() + "F.topk needs a flow tensor score")
    if score.shape[1:] != (1, 1):
        raise FlowError(_where() + f"F.topk needs a score of shape [S, 1, 1], got {list(score.shape)}; reduce the inner axes first")
    tracer = active()
    if tracer is not None:
        tracer.cost("topk", score.shape, score.shape[0])
    return Selection(score)


def keep_only_forced() -> Selection:
    """Select only the always-kept blocks (sinks and the local window): StreamingLLM."""
    return Selection(None)


# Every name a flow may call as `F.name`: the ops, and the selection and state calls.
OPS: dict[str, Callable[..., Any]] = {
    **{name: obj for name, obj in globals().items() if isinstance(obj, Op)},
    **{fn.__name__: fn for fn in (topk, keep_only_forced, save)},
}
