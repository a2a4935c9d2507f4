"""This engine's paged KV pool as a `KVLayout` of the generated kernels.

The pool (`engine/kv_cache.py`) holds K and V per layer as `[blocks + 1, Hkv, block_size, D]`
and a flow's field stores as `[blocks + 1, Hkv, r, c]`: one row per physical block, the last
the null block. A request's logical block j is physical block `table[b, j]` of its block table;
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
    """Rows are physical blocks: the block table's entries (`KVLayout`)."""

    def grid(self, blocks: PagedBlocks) -> tuple[int, int]:
        b, width = blocks.table.shape
        return b, width

    def index_params(self) -> list[str]:
        return ["bt", "stride_bt", "NULL"]

    def index_rows(self, block_size: int) -> list[str]:
        # The table is read over its whole width, not waiting for seq_len: entries past the sequence
        # are loaded (never dereferenced), then replaced by the null block.
        return ["blk = tl.load(bt + b * stride_bt + j, mask=j < W, other=NULL)",
                "blk = tl.where(live, blk, NULL).to(tl.int64)"]

    def index_args(self, blocks: PagedBlocks) -> list[object]:
        return [blocks.table, blocks.table.stride(0), blocks.null]

    def cache_params(self) -> list[str]:
        return ["src", "dst", "bt", "stride_bt", "seq_lens", "NULL"]

    def cache_rows(self, block_size: int) -> list[str]:
        bs = block_size
        return ["if FROM_POSITIONS:",  # decode: src holds each request's new position
                "    pos = tl.load(src + i)",
                f"    blk = tl.load(bt + i * stride_bt + pos // {bs}).to(tl.int64)",
                f"    done = (pos % {bs} == {bs - 1}) & (tl.load(seq_lens + i) > 0)",
                "    dst_blk = tl.where(done, blk, NULL).to(tl.int64)",
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
        return [tile_load(var, f"{pool}_ptr", f"blk * {pool}_s0 + h * {pool}_s1", block_size, head_dim,
                          f"{pool}_s2", "1", over_s, extra)]


PAGED = PagedLayout()
