"""This engine's paged KV pool as a `KVLayout` of the generated kernels.

The pool (`engine/kv_cache.py`) holds K and V per layer as `[blocks + 1, Hkv, block_size, D]`
and a flow's field stores as `[(blocks + 1) * units, Hkv, r, c]`: one row per physical block (per
selection unit of one), the last block the null block. A request's logical block j is physical block `table[b, j]` of its block table;
entries past the sequence are never read (the null block instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparsetune.flow.compile.emit import ptr_params, tile_load, with_strides


class PagedBlocks(NamedTuple):
    """A step's block map: block tables `[B, W]` (int32) and the null block."""

    table: torch.Tensor
    null: int


@dataclass(frozen=True)
class PagedLayout:
    """Rows are physical blocks: the block table's entries (`KVLayout`). With `units` > 1 (a flow's
    `select_block` inside its blocks) the kernels' logical blocks are selection units: unit j of a
    request is unit `j % units` of block `table[b, j // units]`, and its row is that block times
    `units` plus its unit (the field stores hold `units` rows a block)."""

    units: int = 1

    def grid(self, blocks: PagedBlocks) -> tuple[int, int]:
        b, width = blocks.table.shape
        return b, width * self.units

    def index_params(self) -> list[str]:
        return ["bt", "stride_bt", "NULL"]

    def index_rows(self, block_size: int) -> list[str]:
        # The table is read over its whole width, not waiting for seq_len: entries past the sequence
        # are loaded (never dereferenced), then replaced by the null block.
        u = self.units
        if u == 1:
            return ["blk = tl.load(bt + b * stride_bt + j, mask=j < W, other=NULL)",
                    "blk = tl.where(live, blk, NULL).to(tl.int64)"]
        return [f"blk = tl.load(bt + b * stride_bt + j // {u}, mask=j < W, other=NULL).to(tl.int64) * {u} + j % {u}",
                f"blk = tl.where(live, blk, NULL * {u}).to(tl.int64)"]

    def index_args(self, blocks: PagedBlocks) -> list[object]:
        return [blocks.table, blocks.table.stride(0), blocks.null]

    def cache_params(self) -> list[str]:
        return ["src", "dst", "bt", "stride_bt", "seq_lens", "NULL"]

    def cache_rows(self, block_size: int) -> list[str]:
        bs, u = block_size, self.units
        page = bs * u
        row = "blk" if u == 1 else f"blk * {u} + (pos % {page}) // {bs}"
        return ["if FROM_POSITIONS:",  # decode: src holds each request's new position
                "    pos = tl.load(src + i)",
                f"    blk = tl.load(bt + i * stride_bt + pos // {page}).to(tl.int64)",
                f"    blk = {row}",
                f"    done = (pos % {bs} == {bs - 1}) & (tl.load(seq_lens + i) > 0)",
                f"    dst_blk = tl.where(done, blk, NULL * {u}).to(tl.int64)",
                "else:",
                "    blk = tl.load(src + i).to(tl.int64)",
                "    dst_blk = tl.load(dst + i).to(tl.int64)"]

    def copy_args(self, src: torch.Tensor, dst: torch.Tensor) -> list[object]:
        return [src, dst, src, src.stride(0), src, 0]  # the table and lengths are unused

    def decode_args(self, positions: torch.Tensor, blocks: PagedBlocks, seq_lens: torch.Tensor) -> list[object]:
        return [positions, positions, blocks.table, blocks.table.stride(0), seq_lens, blocks.null]

    def pool_params(self, var: str) -> list[str]:
        return ptr_params(var, 3)  # block, head and token strides

    def pool_args(self, pool: torch.Tensor) -> list[object]:
        return with_strides(pool)[:4]

    def token_tile(self, var: str, pool: str, block_size: int, head_dim: int, over_s: bool, extra: str = "") -> list[str]:
        u = self.units
        base = (f"blk * {pool}_s0 + h * {pool}_s1" if u == 1 else
                f"(blk // {u}) * {pool}_s0 + h * {pool}_s1 + (blk % {u}) * {block_size} * {pool}_s2")
        return [tile_load(var, f"{pool}_ptr", base, block_size, head_dim, f"{pool}_s2", "1", over_s, extra)]


PAGED = PagedLayout()


def paged_layout(flow) -> PagedLayout:
    """The engine's paged pool as the generated stages of `flow` see it: its blocks split into the
    flow's selection units (`DecodeFlow.unit`)."""
    units = flow.block_size // flow.unit
    return PAGED if units == 1 else PagedLayout(units)
