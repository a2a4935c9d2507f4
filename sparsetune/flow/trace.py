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
from typing import TYPE_CHECKING, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from sparsetune.flow.values import FT


class Op(Protocol):
    """What a tracing keeps of an op (`flow.ops.Op`): its name, and the op itself for the generator."""

    name: str

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
