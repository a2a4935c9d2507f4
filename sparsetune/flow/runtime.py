"""Running a decode flow inside the engine: the reference executor (torch).

`FlowAttention` is an `AttentionBackend`. On KV write it runs the flow's cache stage for every
block the write completes and stores the fields per physical block. On decode it gathers the
fields of each sequence's blocks, runs the indexer per (request, KV head) row, applies the
always-kept blocks and the budget, takes an exact top-k on device, and attends over the
selected blocks with the sparse paged kernel. Decode reads tensors only (no host values), so
the whole step, indexer included, is captured in the engine's CUDA graphs. A calibrated flow's
per-layer constants (`const`) are tensors passed into the stage functions like the pool, so the
compiled executor sees them as inputs, not as captured attributes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.ops import FT, Fields
from sparsetune.kernels import paged_decode


EXECUTORS = ("reference", "compiled")


def channel_selector(order: Sequence[Sequence[int]], channels: int) -> torch.Tensor:
    """A calibrated flow's constant "channels" for one layer, `[Hkv, channels, D]` (float32): row i
    is one-hot at the i-th most important channel of the KV head (`order`: per head, best first)."""
    idx = torch.tensor(order, dtype=torch.long)
    d = idx.shape[1]
    if channels > d:
        raise SparsetuneError(f"--param channels={channels}: the model's heads have {d} channels; pick at most {d}")
    return torch.nn.functional.one_hot(idx[:, :channels], d).float()


def const_rows(const: dict[str, torch.Tensor], n: int) -> dict[str, FT]:
    """Per-KV-head constants `[Hkv, r, c]` as flow tensors over `n * Hkv` rows ordered (n, head),
    the layout of the stages' rows (blocks x heads in the cache stage, requests x heads in the
    indexer). A view when n == 1 or Hkv == 1, else a small copy: (n, head) rows of a per-head
    constant are no strided view."""
    return {name: FT(c.expand(n, *c.shape).reshape(n * c.shape[0], 1, *c.shape[1:])) for name, c in const.items()}


class FlowAttention(DenseAttention):
    """Executes a decode flow. `executor="reference"` runs the stages op by op in torch (the
    ground truth); `"compiled"` hands the same stage functions to torch.compile, whose Inductor
    backend fuses them into a few Triton kernels on GPU (C++ on CPU)."""

    name = "flow"

    def __init__(
        self, flow: DecodeFlow, scale: float, use_triton: bool | None = None, executor: str = "reference",
        calibration: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """`calibration`: a calibrated flow's channel order per layer and KV head, most important
        first (`flow.calibrate.load_calibration`)."""
        super().__init__(scale, use_triton)
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}")
        if flow.calibrated and calibration is None:
            raise ValueError(f"flow {flow.name!r} is calibrated: pass its channel calibration")
        self.flow = flow
        # Built (and `channels` checked against head_dim) now, on the host; moved to the pool's
        # device and dtype on first use, as the field stores are created (the engine's warm-up
        # step before graph capture is eager).
        self._selectors = [channel_selector(order, flow.channels) for order in calibration] if flow.calibrated else []
        self._const: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [Hkv, r, c]
        self.name = flow.name
        self.executor = executor
        self.fields: dict[int, dict[str, torch.Tensor]] = {}  # layer -> field -> [blocks + 1, Hkv, r, c]
        self.last_selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (blocks, counts)
        # The latest selection of this step, reused by layers outside `select_layers` (TidalDecode).
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self._select_fn = self._select_tensors
        self._cache_fn = self._cache_tensors
        if executor == "compiled":
            # One code object serves every flow class and batch shape; dynamo's default of 8
            # variants per code object is too few once several flows run in one process.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._select_fn = torch.compile(self._select_tensors, dynamic=False)
            self._cache_fn = torch.compile(self._cache_tensors, dynamic=False)

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
            self._run_cache(layer, kv, phys, target, fixed_shape=True)

    def constants(self, layer: int, kv: KVCache) -> dict[str, torch.Tensor]:
        """The flow's constants of `layer` (name → `[Hkv, r, c]`), in the pool's dtype and device."""
        if not self.flow.calibrated:
            return {}
        const = self._const.get(layer)
        if const is None:
            const = self._const[layer] = {"channels": self._selectors[layer].to(kv.k.device, kv.k.dtype)}
        return const

    def _cache_tensors(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, const: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The cache stage on the blocks `src` of one layer's pool → field name → `[T, Hkv, r, c]`."""
        t, h, bs, d = src.numel(), k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
        k, v = FT(k_pool[src].reshape(t * h, 1, bs, d)), FT(v_pool[src].reshape(t * h, 1, bs, d))
        out = self.flow.run_cache(k, v, const_rows(const, t))
        return {name: ft.data.reshape(t, h, *ft.shape[1:]) for name, ft in out.items()}

    def _run_cache(self, layer: int, kv: KVCache, src: torch.Tensor, dst: torch.Tensor, fixed_shape: bool = False) -> None:
        # Prefill chunks vary in size (no point compiling each); decode's shapes are fixed.
        fn = self._cache_fn if fixed_shape else self._cache_tensors
        out = fn(kv.k[layer], kv.v[layer], src, self.constants(layer, kv))
        store = self.fields.get(layer)
        if store is None:
            store = {
                name: torch.zeros(kv.num_blocks + 1, *f.shape[1:], dtype=kv.k.dtype, device=kv.k.device)
                for name, f in out.items()
            }
            self.fields[layer] = store
        for name, f in out.items():
            store[name][dst] = f.to(store[name].dtype)

    # ---- indexer + sparse attention -----------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        blocks, counts = self.select(layer, q, kv, meta)
        sparse = paged_decode.sparse_paged_decode_attention
        fn = sparse if self.triton_path(q) else paged_decode.sparse_paged_decode_attention_ref
        return fn(q, kv.k[layer], kv.v[layer], meta.block_tables, meta.seq_lens, blocks, counts, self.scale)

    def select(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected logical blocks `[B, Hkv, K]` and how many of them count `[B, Hkv]`."""
        reuse = self.flow.select_layers and layer not in self.flow.select_layers
        if reuse:
            if self._shared is None:
                raise RuntimeError(f"layer {layer} reuses a selection but no select layer ran before it")
            blocks, counts = self._shared
        else:
            stores = self.fields.get(layer, {})
            blocks, counts, saved, table = self._select_fn(
                q, meta.block_tables, meta.seq_lens, stores, kv.k[layer] if self.flow.uses_keys else None,
                kv.num_kv_heads, kv.block_size, kv.null_block, self.constants(layer, kv),
            )
            for name, value in saved.items():  # state for the next step; padding lands in the null block
                stores[name][table] = value.to(stores[name].dtype)
            self._shared = (blocks, counts)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # kept for inspection, eager only
            self.last_selection[layer] = (blocks, counts)
        return blocks, counts

    def _select_tensors(
        self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, h: int, bs: int, null_block: int, const: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Indexer + selection as one tensor function (what the compiled executor compiles).
        Returns blocks, counts, the saved state values as `[B, W, Hkv, r, c]` and the block
        table they belong to (entries past each sequence pointing at the null block)."""
        flow = self.flow
        b, hq, d = q.shape
        rows = b * h
        width = block_tables.shape[1]
        nblocks = (seq_lens.long() + bs - 1) // bs  # [B]
        idx = torch.arange(width, device=q.device)
        # Table entries past a sequence's blocks are garbage: read the null block's fields instead.
        table = torch.where(idx < nblocks[:, None], block_tables.long(), null_block)
        nb = nblocks.repeat_interleave(h)  # [R]
        valid = idx < nb[:, None]  # [R, width]

        fields = Fields(
            {
                name: FT(store[table].permute(0, 2, 1, 3, 4).reshape(rows, width, *store.shape[2:]), valid)
                for name, store in stores.items()
            }
        )
        if k_pool is not None:
            # Raw keys [R, W, bs, D]; slots past the sequence end hold stale data: zero them.
            keys = k_pool[table].permute(0, 2, 1, 3, 4)  # [B, Hkv, W, bs, D]
            live = (idx[:, None] * bs + torch.arange(bs, device=q.device)) < seq_lens.long()[:, None, None]  # [B, W, bs]
            keys = keys * live[:, None, :, :, None].to(keys.dtype)
            dict.__setitem__(fields, "k", FT(keys.reshape(rows, width, bs, d), valid))
        sel = flow.run_index(FT(q.reshape(rows, 1, hq // h, d)), fields, const_rows(const, b))
        forced_n = flow.sink_blocks + flow.local_blocks
        if sel.score is None:
            # Only the always-kept blocks (StreamingLLM): their indices are arithmetic, no top-k.
            k = torch.arange(min(width, forced_n), device=q.device)
            tail = nb[:, None] - forced_n + k  # the last local_blocks blocks
            blocks = torch.where((nb[:, None] >= forced_n) & (k >= flow.sink_blocks), tail, k)
            counts = torch.minimum(nb, torch.full_like(nb, forced_n))
            return blocks.to(torch.int32).view(b, h, -1), counts.to(torch.int32).view(b, h), {}, table
        score = sel.score.data.reshape(rows, width).float()
        forced = (idx < flow.sink_blocks) | (idx >= nb[:, None] - flow.local_blocks)
        lowest = torch.finfo(torch.float32).min
        score = score.nan_to_num(nan=lowest, neginf=lowest, posinf=torch.finfo(torch.float32).max)
        score = score.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))

        if flow.budget_ratio is not None:
            want = torch.ceil(nb.double() * flow.budget_ratio).long().clamp(min=forced_n)
            k_max = min(width, flow.budget_blocks(width))
        else:
            want = torch.full_like(nb, flow.budget_blocks(1 << 30))
            k_max = min(width, flow.budget_blocks(width))
        counts = torch.minimum(want, nb)
        top = score.topk(k_max, dim=1).indices  # forced (+inf) first, padding (-inf) last
        saved = {
            name: ft.data.reshape(b, h, width, *ft.shape[1:]).transpose(1, 2) for name, ft in fields.saved.items()
        }
        return top.to(torch.int32).view(b, h, k_max), counts.to(torch.int32).view(b, h), saved, table
