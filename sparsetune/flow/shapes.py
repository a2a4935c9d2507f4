"""Dummy stage inputs, and what a flow's stages produce from them: the inner shape of each field
(`field_dims`) and what the indexer does (`index_traits`). Values are seeded and arbitrary: tracing
and sizing read shapes and op calls, never values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from sparsetune.flow.values import FT, Fields

if TYPE_CHECKING:
    from sparsetune.flow.base import DecodeFlow


@dataclass
class DummyInputs:
    """Seeded random stage inputs over `rows` (request, KV head) rows: the cache stage's one
    unit of keys and values `[rows, 1, unit, head_dim]`, and the constants `[rows, 1, r, c]`.
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
        rows, g = self.k.data.shape[0], self.gen
        lens = torch.tensor([num_blocks] + [max(1, num_blocks - 2)] * (rows - 1))
        valid = torch.arange(num_blocks)[None, :] < lens[:, None]
        fields = Fields({n: FT(torch.randn(rows, num_blocks, *rc, generator=g), valid) for n, rc in field_dims.items()})
        if self.flow.uses_keys:
            keys = torch.randn(rows, num_blocks, self.flow.unit, self.head_dim, generator=g)
            dict.__setitem__(fields, "k", FT(keys, valid))
        return FT(torch.randn(rows, 1, group, self.head_dim, generator=g)), fields


def dummy_inputs(flow: DecodeFlow, head_dim: int, rows: int = 1,
                 const_dims: dict[str, tuple[int, int]] | None = None) -> DummyInputs:
    """The one builder of dummy stage inputs (constants shaped by `flow.const_dims` unless given)."""
    g = torch.Generator().manual_seed(0)
    const_dims = flow.const_dims(head_dim) if const_dims is None else const_dims
    k, v = (FT(torch.randn(rows, 1, flow.unit, head_dim, generator=g)) for _ in range(2))
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


def field_bytes_per_unit(flow: DecodeFlow, mcfg, pool_bytes: int) -> int:
    """A flow's cached fields of one selection unit on one layer, all KV heads, in bytes beside a pool
    of `pool_bytes`-byte elements (`DecodeFlow.field_itemsize`: 8-bit fields take one): what the
    engine stores."""
    dims = field_dims(flow, mcfg.head_dim, flow.const_dims(mcfg.head_dim))
    return mcfg.num_key_value_heads * sum(r * c for r, c in dims.values()) * flow.field_itemsize(pool_bytes)


def field_bytes_per_block(flow: DecodeFlow | None, mcfg, pool_bytes: int) -> int:
    """A flow's fields per KV block (those of each selection unit in it) on its sparse layers, in
    bytes (`field_bytes_per_unit`): they live beside the pool (a two-level flow keeps its blocks'
    fields too). What the engine reserves per block, and what the cost model counts as memory."""
    if flow is None:
        return 0
    layers = sum(1 for i in range(mcfg.num_hidden_layers) if i not in flow.dense_layers)
    own = layers * (flow.block_size // flow.unit) * field_bytes_per_unit(flow, mcfg, pool_bytes)
    return own + field_bytes_per_block(flow.page_flow(), mcfg, pool_bytes)


def index_traits(flow: DecodeFlow, head_dim: int, const_dims: dict[str, tuple[int, int]] | None = None) -> IndexTraits:
    """What the indexer does, found by running it once on dummy inputs."""
    x = dummy_inputs(flow, head_dim, const_dims=const_dims)
    q, fields = x.index(field_dims(flow, head_dim, const_dims), group=2)
    sel = flow.run_index(q, fields, x.const)
    return IndexTraits(bool(fields.saved), sel.score is None)
