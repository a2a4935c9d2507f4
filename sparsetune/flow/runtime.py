"""Running a decode flow inside the engine: the reference executor (torch).

`FlowAttention` is an `AttentionBackend`. On KV write it runs the flow's cache stage for every
block the write completes and stores the fields per physical block. On decode it gathers the
fields of each sequence's blocks, runs the indexer per (request, KV head) row, applies the
always-kept blocks and the budget, takes an exact top-k on device, and attends over the
selected blocks with the sparse paged kernel. Decode reads tensors only (no host values), so
the whole step, indexer included, is captured in the engine's CUDA graphs.
"""

from __future__ import annotations

import torch

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.ops import FT
from sparsetune.kernels import paged_decode


class FlowAttention(DenseAttention):
    name = "flow"

    def __init__(self, flow: DecodeFlow, scale: float, use_triton: bool | None = None) -> None:
        super().__init__(scale, use_triton)
        self.flow = flow
        self.name = flow.name
        self.fields: dict[int, dict[str, torch.Tensor]] = {}  # layer -> field -> [blocks + 1, Hkv, r, c]
        self.last_selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (blocks, counts)

    # ---- cache stage ------------------------------------------------------------------------------

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> None:
        super().write_kv(layer, k, v, kv, meta)
        bs = kv.block_size
        if meta.is_prefill:
            # Blocks completed by this chunk: b with ctx <= (b+1)*bs - 1 < seq_len.
            done = [
                meta.block_tables[i, meta.context_len(i) // bs : meta.seq_lens_cpu[i] // bs]
                for i in range(meta.batch_size)
            ]
            blocks = torch.cat(done).long()
            if blocks.numel():
                self._run_cache(layer, kv, blocks, blocks)
        else:
            pos = meta.positions
            phys = meta.block_tables.gather(1, (pos // bs).view(-1, 1)).view(-1).long()
            completing = ((pos % bs) == bs - 1) & (meta.seq_lens > 0)
            # Graph-safe: every row computes; rows that complete nothing write to the null block.
            target = torch.where(completing, phys, torch.full_like(phys, kv.null_block))
            self._run_cache(layer, kv, phys, target)

    def _run_cache(self, layer: int, kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        t, h, bs, d = src.numel(), kv.num_kv_heads, kv.block_size, kv.head_dim
        k = FT(kv.k[layer][src].reshape(t * h, 1, bs, d))
        v = FT(kv.v[layer][src].reshape(t * h, 1, bs, d))
        out = self.flow.cache(k, v)
        store = self.fields.get(layer)
        if store is None:
            store = {
                name: torch.zeros(kv.num_blocks + 1, h, *ft.shape[1:], dtype=kv.k.dtype, device=kv.k.device)
                for name, ft in out.items()
            }
            self.fields[layer] = store
        for name, ft in out.items():
            store[name][dst] = ft.data.reshape(t, h, *ft.shape[1:]).to(store[name].dtype)

    # ---- indexer + sparse attention -----------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        blocks, counts = self.select(layer, q, kv, meta)
        triton_path = q.is_cuda if self.use_triton is None else self.use_triton
        fn = paged_decode.sparse_paged_decode_attention if triton_path else paged_decode.sparse_paged_decode_attention_ref
        return fn(q, kv.k[layer], kv.v[layer], meta.block_tables, meta.seq_lens, blocks, counts, self.scale)

    def select(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected logical blocks `[B, Hkv, K]` and how many of them count `[B, Hkv]`."""
        flow, bs = self.flow, kv.block_size
        b, hq, d = q.shape
        h = kv.num_kv_heads
        rows = b * h
        width = meta.block_tables.shape[1]
        nblocks = (meta.seq_lens.long() + bs - 1) // bs  # [B]
        idx = torch.arange(width, device=q.device)
        # Table entries past a sequence's blocks are garbage: read the null block's fields instead.
        table = torch.where(idx < nblocks[:, None], meta.block_tables.long(), kv.null_block)
        nb = nblocks.repeat_interleave(h)  # [R]
        valid = idx < nb[:, None]  # [R, width]

        sel = flow.index(
            FT(q.reshape(rows, 1, hq // h, d)),
            {
                name: FT(store[table].permute(0, 2, 1, 3, 4).reshape(rows, width, *store.shape[2:]), valid)
                for name, store in self.fields.get(layer, {}).items()
            },
        )
        if sel.score is None:
            score = torch.zeros(rows, width, device=q.device)
        else:
            score = sel.score.data.reshape(rows, width).float()
        forced = (idx < flow.sink_blocks) | (idx >= nb[:, None] - flow.local_blocks)
        lowest = torch.finfo(torch.float32).min
        score = score.nan_to_num(nan=lowest, neginf=lowest, posinf=torch.finfo(torch.float32).max)
        score = score.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))

        forced_n = flow.sink_blocks + flow.local_blocks
        if sel.score is None:
            want = torch.full_like(nb, forced_n)
            k_max = min(width, forced_n)
        elif flow.budget_ratio is not None:
            want = torch.ceil(nb.double() * flow.budget_ratio).long().clamp(min=forced_n)
            k_max = min(width, flow.budget_blocks(width))
        else:
            want = torch.full_like(nb, flow.budget_blocks(1 << 30))
            k_max = min(width, flow.budget_blocks(width))
        counts = torch.minimum(want, nb)
        top = score.topk(k_max, dim=1).indices  # forced (+inf) first, padding (-inf) last
        blocks = top.to(torch.int32).view(b, h, k_max)
        counts = counts.to(torch.int32).view(b, h)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # kept for inspection, eager only
            self.last_selection[layer] = (blocks, counts)
        return blocks, counts
