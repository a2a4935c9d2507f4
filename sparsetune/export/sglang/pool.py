"""SGLang's KV pool as this engine's paged pool: what the decode backend's `FlowAttention` and a reuse
plan's `Rows` read and write.

SGLang's `MHATokenToKVPool` is flat, `k_buffer[layer]` `[slots, Hkv, D]`, with `req_to_token[row, pos] ->
slot` and pages of `page_size` consecutive slots. Its buffers viewed `[pages, Hkv, P, D]` (strided, not
copied) and the page table `req_to_token[req_pool_indices, ::P] // P` are this engine's `KVCache` and
block table, pages the blocks; page 0 (SGLang's padding page) is the null block.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sparsetune.engine.kv_cache import KVCache


class _Layers:
    """One of SGLang's K or V buffers, per layer, as this engine's `[pages, Hkv, P, D]` blocks."""

    def __init__(self, get, page_size: int, like: torch.Tensor) -> None:
        self._get, self._page = get, page_size
        self.dtype, self.device, self.is_cuda = like.dtype, like.device, like.is_cuda

    def __getitem__(self, layer: int) -> torch.Tensor:
        buf = self._get(layer)  # [slots, Hkv, D], slots = pages * P
        return buf.view(-1, self._page, buf.shape[1], buf.shape[2]).permute(0, 2, 1, 3)


class PagedPool(KVCache):
    """SGLang's `MHATokenToKVPool` seen as this engine's paged pool (a `KVCache` over SGLang's buffers,
    not its own: what `FlowAttention` and a reuse plan's `Rows` read and write): blocks are pages,
    block 0 (SGLang's padding page) the null block."""

    null_block = 0
    null_slot = 0

    def __init__(self, pool: MHATokenToKVPool, page_size: int) -> None:  # SGLang allocated the buffers
        k0 = pool.get_key_buffer(pool.start_layer)
        self.block_size = page_size
        self.num_blocks = k0.shape[0] // page_size
        self.num_kv_heads, self.head_dim = k0.shape[1], k0.shape[2]
        self.k = _Layers(pool.get_key_buffer, page_size, k0)
        self.v = _Layers(pool.get_value_buffer, page_size, k0)


def page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """`[B, pages]` int32 page ids of each request's first `pages` pages (past its end: page 0)."""
    return (req_to_token.index_select(0, req_pool_indices.long())[:, : pages * page_size : page_size] // page_size).to(torch.int32)
