"""Op graph → Triton statements over named tiles (layout-agnostic).

Every value is a 3-D tile `[S, a, b]`: S = BLOCK_S for values that vary over blocks, 1 for
block-constant ones (the query, constants, anything in the cache stage); inner axes are padded
to powers of two, and reductions (the contraction of `gemm` included) mask the padding with
their neutral element, so padding never reaches a real value. Each op's own emission is its
`ops.Op.emit`; this module gives it operands, helpers and the statement list.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from sparsetune.flow.ops import FT
from sparsetune.flow.trace import GraphNode


class NotBlockLocal(Exception):
    """The stage cannot become one block-local kernel; the message says which op and why."""


class ForcedOnly(NotBlockLocal):
    """The indexer scores nothing (`F.keep_only_forced`): the selection is arithmetic, no kernel."""


def p2(n: int) -> int:
    """The power of two a tile axis of `n` is padded to."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class Tile:
    """A value of generated code: `[S or 1, a, b]` in the variable `name`."""

    name: str
    s: bool  # varies over blocks
    a: int
    b: int
    is_bool: bool = False
    # Its values are those of the query or the fields, or chosen among them (relu, min, max, where,
    # abs of them): a 16-bit dtype holding those inputs holds these exactly (`Emitter.dot_matvec`).
    exact16: bool = False

    def shape(self) -> str:
        return f"[{'BLOCK_S' if self.s else 1}, {p2(self.a)}, {p2(self.b)}]"


# Ops whose every output value is one of their operands' values, or its negation or zero.
_SELECTING_OPS = frozenset({"relu", "abs", "maximum", "minimum", "where"})


def _exact16(x: object) -> bool:
    """A number both 16-bit float dtypes hold exactly (an operand of a `_SELECTING_OPS` op)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and all(
        float(torch.tensor(float(x), dtype=t)) == float(x) for t in (torch.bfloat16, torch.float16))


def tile_load(var: str, ptr: str, base: str, r: int, c: int, s2: str, s3: str, over_s: bool, extra: str = "") -> str:
    """`var = ` a `[S or 1, r, c]` fp32 tile at `ptr + base + i*s2 + j*s3` (`base` is a vector
    over the tile's blocks when `over_s`), padding read as 0; `extra`: more of the mask."""
    ri, ci = f"tl.arange(0, {p2(r)})", f"tl.arange(0, {p2(c)})"
    base = f"({base})[:, None, None]" if over_s else base
    mask = f"({ri} < {r})[None, :, None] & ({ci} < {c})[None, None, :]{extra}"
    return (f"{var} = tl.load({ptr} + {base} + {ri}[None, :, None] * {s2} + {ci}[None, None, :] * {s3},"
            f" mask={mask}, other=0.0).to(tl.float32)")


def ptr_params(var: str, ndim: int) -> list[str]:
    """Kernel parameters of one tensor: its pointer and `ndim` strides (see `with_strides`)."""
    return [f"{var}_ptr"] + [f"{var}_s{i}" for i in range(ndim)]


def with_strides(t: torch.Tensor) -> list[object]:
    """Launch arguments of one tensor: itself and its strides (matching `ptr_params`)."""
    return [t, *t.stride()]


def kernel_source(name: str, signature: list[str], lines: list[str], doc: str) -> str:
    """A module holding one kernel; its docstring written as a literal (`repr`), so no text of a
    flow's can end it early."""
    return "\n".join([repr(doc), "import triton", "import triton.language as tl", "", "", "@triton.jit",
                      f"def {name}({', '.join(signature)}):", *(f"    {line}" for line in lines), ""])


@dataclass
class Emitter:
    """Turns recorded op nodes into Triton statements over named input tiles: each op's own
    emission (`ops.Op.emit`), given its tensor arguments as tiles and this emitter's helpers."""

    inputs: dict[int, tuple[str, bool]]  # id(FT) -> (variable, varies over blocks)
    tiles: dict[int, Tile] = field(default_factory=dict)
    body: list[str] = field(default_factory=list)
    # `body` split by what a statement varies over: the query's and constants' own math (`row_math`,
    # the same for every block of a row) and the rest (`per_block`); each keeps `body`'s order.
    row_math: list[str] = field(default_factory=list)
    per_block: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    biggest: int = 1  # the largest per-block intermediate over blocks, in elements (sets BLOCK_S)
    biggest_dot: int = 1  # the same where the products emitted by `dot_matvec` run (DOT on)
    dots: bool = False  # some product has a tensor-core form (`dot_matvec`)
    row_products: bool = False  # the row math has a product (F.gemm, e.g. the query on its channels)
    allow_dot: bool = False  # the kernel has the constexprs DOT and DOT_T (the indexer)

    p2 = staticmethod(p2)

    def tensor(self, x: FT) -> Tile:
        """The tile of a flow tensor: a stage input or an earlier op's output."""
        if id(x) not in self.tiles:
            if id(x) not in self.inputs:
                raise NotBlockLocal("a tensor comes from outside the flow op set")
            var, over_s = self.inputs[id(x)]
            self.used.add(var)
            self.tiles[id(x)] = Tile(var, over_s, x.shape[1], x.shape[2], exact16=var == "q_in" or var.startswith("f_"))
        return self.tiles[id(x)]

    def ref(self, x: Tile | float) -> str:
        """An operand: a tile's variable or a number's literal."""
        if isinstance(x, Tile):
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
        return f"(tl.arange(0, {p2(n)}) < {n})[{', '.join(idx)}]"

    def stmt(self, line: str) -> None:
        """A statement placed before the op's own assignment."""
        self.body.append(line)

    def grow(self, elems: int, with_dot: int | None = None) -> None:
        """An intermediate of `elems` elements per block (BLOCK_S shrinks to fit); `with_dot`: its
        size in the kernel's DOT form, where that differs."""
        self.biggest = max(self.biggest, elems)
        self.biggest_dot = max(self.biggest_dot, elems if with_dot is None else with_dot)

    def dot_matvec(self, out: Tile, x: Tile, y: Tile, fallback: str) -> str | None:
        """A block-varying row `[S, 1, k]` times a block-constant matrix `[1, n, k]` (either order:
        a centroid against the query group) as one tensor-core `tl.dot` over the program's blocks,
        under the kernel's constexpr `DOT` (else `fallback`). Only for tiles of the query's and the
        fields' values (`Tile.exact16`), which the 16-bit `DOT_T` holds exactly when the launch turns
        DOT on (all stored in it), so the products are exact and the sum fp32, as in `fallback`. The group axis
        is repeated to the 16 columns `tl.dot` needs (and the copies folded back by a max, exact).
        None where the form does not apply."""
        row, mat = (x, y) if x.s else (y, x)
        k = x.b
        if not (self.allow_dot and row.s and not mat.s and row.a == 1 and k == p2(k) >= 16 and p2(mat.a) <= 16
                and row.exact16 and mat.exact16):
            return None
        n = p2(mat.a)
        rep = 16 // n
        matt = f"tl.reshape(tl.trans(tl.reshape({mat.name}, ({n}, {k}))), ({k}, 1, {n}))"
        cols = f"tl.reshape(tl.broadcast_to({matt}, ({k}, {rep}, {n})), ({k}, {rep * n}))"
        prod = (f"tl.dot(tl.reshape({row.name}, (BLOCK_S, {k})).to(DOT_T), {cols}.to(DOT_T), "
                f"input_precision='ieee')")
        dot = f"tl.expand_dims(tl.max(tl.reshape({prod}, (BLOCK_S, {rep}, {n})), axis=1), {1 if x is row else 2})"
        self.dots = True
        self.grow(n * k, with_dot=rep * n)  # the fallback's product tile [S, n, k]; the dot's [S, 16]
        self.stmt("if DOT:")
        self.stmt(f"    {out.name} = {dot}")
        self.stmt("else:")
        self.stmt(f"    {out.name} = {fallback}")
        return out.name

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
            s = any(isinstance(v, Tile) and v.s for v in args.values())
            out = Tile(f"v{len(self.body)}", s, *node.out.shape[1:], node.out.data.dtype == torch.bool)
            values = [v for k, v in args.items() if k != "cond"]
            out.exact16 = op.name in _SELECTING_OPS and all(
                v.exact16 if isinstance(v, Tile) else _exact16(v) for v in values)
            start = len(self.body)
            code = op.emit(self, out, **args)
            if out.s:  # block-constant values (the query's own math) do not grow with BLOCK_S
                self.grow(p2(out.a) * p2(out.b))
            self.tiles[id(node.out)] = out
            self.row_products |= not out.s and op.name == "gemm"  # F.gemm: the op set's one product
            self.body.append(f"{out.name} = {code}")
            (self.per_block if out.s else self.row_math).extend(self.body[start:])  # a row value reads row values only

    def const_loads(self, const: dict[str, FT]) -> tuple[tuple[str, ...], list[str], list[str]]:
        """The constants the emitted code reads (`c_<name>`, per KV head h): their names,
        kernel parameters and tile loads."""
        used = tuple(n for n in const if f"c_{n}" in self.used)
        params = [p for n in used for p in ptr_params(f"c_{n}", 3)]
        loads = [tile_load(f"c_{n}", f"c_{n}_ptr", f"h * c_{n}_s0", *const[n].shape[1:], f"c_{n}_s1", f"c_{n}_s2", False)
                 for n in used]
        return used, params, loads
