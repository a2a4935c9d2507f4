"""Tracing a flow stage: what its ops record while it runs, and the dummy inputs it runs on.

`with tracing() as t:` makes `t` the active tracer of this context (a `ContextVar`, so threads
and nested tracings keep their own): every flow op called inside appends a `GraphNode` (the op,
its arguments and output: what the kernel generator reads) and an `OpRecord` (its cost and the
flow line that called it: what `flows check` reports). Outside a tracing, ops record nothing.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple

import torch

if TYPE_CHECKING:
    from sparsetune.flow.base import DecodeFlow
    from sparsetune.flow.ops import FT, Fields, Op

_FLOW_DIR = str(Path(__file__).parent)


@dataclass
class OpRecord:
    """One op call's cost, at the flow line that made it (what `flows check` reports)."""

    op: str
    line: int | None
    out_shape: tuple[int, ...]
    flops: int  # per row


@dataclass
class GraphNode:
    """One op call, as the kernel generator reads a stage."""

    op: Op
    args: tuple
    kwargs: dict
    out: FT


@dataclass
class Tracer:
    """The op calls of one tracing, in order."""

    nodes: list[GraphNode] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)

    def record(self, op: Op, args: tuple, kwargs: dict, out: FT, flops: int) -> None:
        """One op call: its graph node and its cost."""
        self.nodes.append(GraphNode(op, args, kwargs, out))
        self.cost(op.name, out.shape, flops)

    def cost(self, op: str, out_shape: tuple[int, ...], flops: int) -> None:
        """A cost record, at the flow line that called the op."""
        loc = caller_line()
        self.records.append(OpRecord(op, loc[1] if loc else None, out_shape, int(flops)))


_ACTIVE: ContextVar[Tracer | None] = ContextVar("sparsetune_flow_tracer", default=None)


@contextmanager
def tracing() -> Iterator[Tracer]:
    """Record the flow ops called inside the block."""
    tracer = Tracer()
    token = _ACTIVE.set(tracer)
    try:
        yield tracer
    finally:
        _ACTIVE.reset(token)


def active() -> Tracer | None:
    """The tracer of the current context; None outside a tracing (and always inside torch.compile,
    which never traces and would break its graph on the context lookup)."""
    return None if torch.compiler.is_compiling() else _ACTIVE.get()


def caller_line() -> tuple[str, int] | None:
    """The first frame outside this package: the flow program's own file and line."""
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_FLOW_DIR):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


# ---- dummy inputs -------------------------------------------------------------------------------


@dataclass
class DummyInputs:
    """Seeded random stage inputs over `rows` (request, KV head) rows: the cache stage's one
    block of keys and values `[rows, 1, block_size, head_dim]`, and the constants `[rows, 1, r, c]`.
    Values are arbitrary: tracing reads shapes and op calls."""

    flow: DecodeFlow
    head_dim: int
    k: FT
    v: FT
    const: dict[str, FT]
    gen: torch.Generator

    def index(self, field_dims: dict[str, tuple[int, int]], group: int, num_blocks: int = 5) -> tuple[FT, Fields]:
        """The indexer's query `[rows, 1, group, head_dim]` and fields `[rows, num_blocks, r, c]` (raw
        keys as "k" when the flow reads them); rows after the first end two blocks early (padding)."""
        from sparsetune.flow.values import FT, Fields

        rows, g = self.k.data.shape[0], self.gen
        lens = torch.tensor([num_blocks] + [max(1, num_blocks - 2)] * (rows - 1))
        valid = torch.arange(num_blocks)[None, :] < lens[:, None]
        fields = Fields({n: FT(torch.randn(rows, num_blocks, *rc, generator=g), valid) for n, rc in field_dims.items()})
        if self.flow.uses_keys:
            keys = torch.randn(rows, num_blocks, self.flow.block_size, self.head_dim, generator=g)
            dict.__setitem__(fields, "k", FT(keys, valid))
        return FT(torch.randn(rows, 1, group, self.head_dim, generator=g)), fields


def dummy_inputs(flow: DecodeFlow, head_dim: int, rows: int = 1,
                 const_dims: dict[str, tuple[int, int]] | None = None) -> DummyInputs:
    """The one builder of dummy stage inputs (constants shaped by `flow.const_dims` unless given)."""
    from sparsetune.flow.values import FT

    g = torch.Generator().manual_seed(0)
    const_dims = flow.const_dims(head_dim) if const_dims is None else const_dims
    k, v = (FT(torch.randn(rows, 1, flow.block_size, head_dim, generator=g)) for _ in range(2))
    const = {n: FT(torch.randn(rows, 1, *rc, generator=g)) for n, rc in const_dims.items()}
    return DummyInputs(flow, head_dim, k, v, const, g)


def field_dims(flow: DecodeFlow, head_dim: int, const_dims: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """The inner shape `(r, c)` of each field the cache stage writes (from one dummy block)."""
    from sparsetune.flow.values import check_name

    x = dummy_inputs(flow, head_dim, const_dims=const_dims)
    return {check_name(n, "field name"): tuple(t.shape[1:]) for n, t in flow.run_cache(x.k, x.v, x.const).items()}  # type: ignore[misc]


class IndexTraits(NamedTuple):
    saves_state: bool  # the indexer saves state with F.save
    forced_only: bool  # it scores nothing (F.keep_only_forced): the selection is the always-kept blocks


def index_traits(flow: DecodeFlow, head_dim: int, const_dims: dict[str, tuple[int, int]] | None = None) -> IndexTraits:
    """What the indexer does, found by running it once on dummy inputs."""
    x = dummy_inputs(flow, head_dim, const_dims=const_dims)
    q, fields = x.index(field_dims(flow, head_dim, const_dims), group=2)
    sel = flow.run_index(q, fields, x.const)
    return IndexTraits(bool(fields.saved), sel.score is None)
