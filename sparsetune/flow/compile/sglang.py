"""SGLang's token-paged KV pool as a `KVLayout` of the generated kernels (issue #16).

SGLang keeps K and V per layer as flat slot buffers `[slots, Hkv, D]` (`MHATokenToKVPool`,
`k_buffer[layer]`, NHD) and a request's token at position p in slot `req_to_token[req, p]`
(`ReqToTokenPool`, row `req_pool_indices[b]` of the batch's request b; row 0 and slot 0 are
padding). Its paged allocator hands out whole pages of `page_size` slots, page-aligned: position
p of a request sits at `page * page_size + p % page_size`. With `page_size == block_size` a
flow's block is one page, so pages are the field rows: block j of request b is page
`req_to_token[req, j * bs] // bs`, its tokens the `bs` slots from `page * bs` (one strided load,
no gather), and a flow's field stores are `[pages + 1, Hkv, r, c]`, the last row the null row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparsetune.flow.compile.emit import tile_load
from sparsetune.flow.compile.layout import position_rows


class SGLangBlocks(NamedTuple):
    """A step's block map on SGLang's pool: `req_to_token` `[rows, max_context]` (int32), the
    batch's `req_pool_indices` `[B]`, the widest request in blocks, and the null row."""

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    width: int
    null: int


@dataclass(frozen=True)
class SGLangLayout:
    """Rows are SGLang's pages (`KVLayout`); valid only with the pool's page size = the block size."""

    def grid(self, blocks: SGLangBlocks) -> tuple[int, int]:
        return blocks.req_pool_indices.shape[0], blocks.width

    def index_params(self) -> list[str]:
        return ["r2t", "stride_r2t", "rpi", "NULL"]

    def index_rows(self, block_size: int) -> list[str]:
        bs = block_size
        return ["req = tl.load(rpi + b).to(tl.int64)",
                f"blk = tl.load(r2t + req * stride_r2t + j * {bs}, mask=live, other=NULL * {bs}).to(tl.int64) // {bs}"]

    def index_args(self, blocks: SGLangBlocks) -> list[object]:
        return [blocks.req_to_token, blocks.req_to_token.stride(0), blocks.req_pool_indices, blocks.null]

    def cache_params(self) -> list[str]:
        return ["src", "dst", "r2t", "stride_r2t", "rpi", "seq_lens", "NULL"]

    def cache_rows(self, block_size: int) -> list[str]:
        return position_rows(["req = tl.load(rpi + i).to(tl.int64)",
                              f"blk = tl.load(r2t + req * stride_r2t + pos).to(tl.int64) // {block_size}"], block_size)

    def copy_args(self, src: torch.Tensor, dst: torch.Tensor) -> list[object]:
        return [src, dst, src, 0, src, src, 0]  # pages given: the request map and lengths are unused

    def decode_args(self, positions: torch.Tensor, blocks: SGLangBlocks, seq_lens: torch.Tensor) -> list[object]:
        r2t = blocks.req_to_token
        return [positions, positions, r2t, r2t.stride(0), blocks.req_pool_indices, seq_lens, blocks.null]

    def pool_params(self, var: str) -> list[str]:
        return [f"{var}_ptr", f"{var}_s0", f"{var}_s1"]  # slot and head strides

    def pool_args(self, pool: torch.Tensor) -> list[object]:
        return [pool, pool.stride(0), pool.stride(1)]

    def token_tile(self, var: str, pool: str, block_size: int, head_dim: int, over_s: bool, extra: str = "") -> list[str]:
        return [tile_load(var, f"{pool}_ptr", f"blk * {block_size} * {pool}_s0 + h * {pool}_s1", block_size, head_dim,
                          f"{pool}_s0", "1", over_s, extra)]


SGLANG = SGLangLayout()
