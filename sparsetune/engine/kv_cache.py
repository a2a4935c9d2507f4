"""The paged KV pool: per layer, K and V as `[num_blocks + 1, kv_heads, block_size, head_dim]`.

One block of one KV head is a contiguous `block_size * head_dim` run, so a
decode kernel (dense or sparse) reads whole blocks per head with wide loads.
The extra last block is the *null block*: padded rows of a CUDA-graph batch
write their KV there, so stores never need a branch and never touch live data.
"""

from __future__ import annotations

from contextlib import nullcontext as _nothing

import torch

from sparsetune.kernels import kv_store


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
        # On CUDA the pool has a memory pool of its own: freed (a new block size, `Engine.set_block_size`),
        # its tens of GiB go back whole, where in the shared pool a few small tensors placed in the freed
        # segment would pin it and the next layout would not fit (seen on an H200 in a search).
        self.mem_pool = torch.cuda.MemPool() if torch.device(device).type == "cuda" else None
        with torch.cuda.use_mem_pool(self.mem_pool) if self.mem_pool is not None else _nothing():
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def null_slot(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()

    def slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slots (`block * block_size + offset`) of token `positions` of a sequence with `block_table`."""
        bs = self.block_size
        return block_table[positions // bs].long() * bs + positions % bs

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' `[N, kv_heads, head_dim]` K/V at flat slots `block * block_size + offset`."""
        fn = kv_store.store_kv if k.is_cuda else kv_store.store_kv_ref
        fn(k, v, self.k[layer], self.v[layer], slot_mapping)

    def read(self, layer: int, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[N, kv_heads, head_dim]` K and V at flat slots (the counterpart of `store`)."""
        blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
        return self.k[layer][blk, :, off], self.v[layer][blk, :, off]

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` tokens as `[kv_heads, length, head_dim]` K and V (contiguous
        on CUDA, `kv_store.gather_kv`; the torch twin elsewhere)."""
        ids = block_table[: -(-length // self.block_size)].long()
        fn = kv_store.gather_kv if self.k.is_cuda else kv_store.gather_kv_ref
        return fn(self.k[layer], self.v[layer], ids, length)
