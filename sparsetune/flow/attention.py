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
from sparsetune.engine.stages import stage
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.compile import (
    CacheKernel, ForcedOnly, IndexerKernel, NotBlockLocal, PagedBlocks, build_cache, build_indexer,
)
from sparsetune.flow.ops import FT, Fields
from sparsetune.flow.trace import field_dims, saves_state
from sparsetune.kernels import paged_decode
from sparsetune.kernels.select_topk import select_topk


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
    ground truth). `"compiled"` on GPU runs a generated Triton kernel per block-local stage
    (`flow.compile`) and the radix-select top-k, and hands other stages to torch.compile; on CPU
    it torch.compiles the same stage functions (C++)."""

    name = "flow"

    def __init__(
        self, flow: DecodeFlow, scale: float, use_triton: bool | None = None, executor: str = "reference",
        calibration: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """`calibration`: a calibrated flow's channel order per layer and KV head, most important
        first (`models.artifacts.resolve_calibration`)."""
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
        self._score_fn = self._score_tensors
        self._cache_fn = self._cache_tensors
        # The generated kernels (indexer, cache stage), built on first use; None: not block-local.
        self._generated: dict[str, IndexerKernel | CacheKernel | None] = {}
        self._saves_state: bool | None = None  # F.save in the indexer (found on first use)
        self.paths: dict[str, str] = {}  # stage -> how the compiled executor runs it (for reports)
        self._forced_only = False  # the indexer keeps only sink/local blocks (known once it is traced)
        if executor == "compiled":
            # One code object serves every flow class and batch shape; dynamo's default of 8
            # variants per code object is too few once several flows run in one process.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._select_fn = torch.compile(self._select_tensors, dynamic=False)
            self._score_fn = torch.compile(self._score_tensors, dynamic=False)
            self._cache_fn = torch.compile(self._cache_tensors, dynamic=False)

    def _generated_path(self, x: torch.Tensor) -> bool:
        """The compiled executor on the Triton path runs sparsetune's own kernels: the generated
        stages where they are block-local, the radix-select top-k always."""
        return self.executor == "compiled" and self.triton_path(x)

    def _indexer_kernel(self, kv: KVCache, group: int) -> IndexerKernel | None:
        """The generated indexer (None: not block-local; the compiled torch indexer runs), built once."""
        if "index" not in self._generated:
            try:
                self._generated["index"] = build_indexer(self.flow, group, kv.head_dim)
                self.paths["index"] = "generated Triton kernel + radix-select top-k"
            except ForcedOnly:
                self._generated["index"], self._forced_only = None, True
                self.paths["index"] = "torch.compile (always-kept blocks only: arithmetic, no top-k)"
            except NotBlockLocal as e:
                self._generated["index"] = None
                self.paths["index"] = f"torch.compile (not block-local: {e}) + radix-select top-k"
        return self._generated["index"]  # type: ignore[return-value]

    def _cache_kernel(self, kv: KVCache) -> CacheKernel | None:
        """The generated cache stage (None: not block-local; the compiled torch stage runs), built once."""
        if "cache" not in self._generated:
            try:
                self._generated["cache"] = build_cache(self.flow, kv.head_dim)
                self.paths["cache"] = "generated Triton kernel"
            except NotBlockLocal as e:
                self._generated["cache"] = None
                self.paths["cache"] = f"torch.compile (not block-local: {e})"
        return self._generated["cache"]  # type: ignore[return-value]

    def _stores(self, layer: int, kv: KVCache) -> dict[str, torch.Tensor]:
        """Layer's field stores, `[blocks + 1, Hkv, r, c]` each (the last block is the null block)."""
        store = self.fields.get(layer)
        if store is None:
            dims = field_dims(self.flow, kv.head_dim)
            store = self.fields[layer] = {
                name: torch.zeros(kv.num_blocks + 1, kv.num_kv_heads, *rc, dtype=kv.k.dtype, device=kv.k.device)
                for name, rc in dims.items()
            }
        return store

    # ---- cache stage ------------------------------------------------------------------------------

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> None:
        super().write_kv(layer, k, v, kv, meta)
        with stage("cache_stage"):
            self._write_fields(layer, kv, meta)

    def _write_fields(self, layer: int, kv: KVCache, meta: AttentionMetadata) -> None:
        """The cache stage for the blocks this step's KV write completed. A block the write starts but
        does not complete gets zero fields: it may hold a previous owner's (a flow's state included)."""
        bs = kv.block_size
        if meta.is_prefill:
            # Blocks completed by this chunk: b with ctx <= (b+1)*bs - 1 < seq_len.
            done, open_ = [], []
            for i in range(meta.batch_size):
                ctx, end = meta.context_len(i), meta.seq_lens_cpu[i]
                done.append(meta.block_tables[i, ctx // bs : end // bs])
                if end % bs and end // bs >= ctx // bs:
                    open_.append(meta.block_tables[i, end // bs : end // bs + 1])
            if open_:
                self.zero_fields(layer, kv, torch.cat(open_).long())
            blocks = torch.cat(done).long()
            if blocks.numel():
                self._run_cache(layer, kv, blocks, blocks)
        else:
            pos = meta.positions
            cache = self._cache_kernel(kv) if self._generated_path(kv.k) else None
            store = self._stores(layer, kv)
            generated, stateful = cache is not None and bool(store), self._stateful(kv)
            if stateful or not generated:  # the generated stage finds the blocks itself
                phys = meta.block_tables.gather(1, (pos // bs).view(-1, 1)).view(-1).long()
            if stateful:  # a stateless flow never reads the open block's fields (always kept)
                # Graph-safe: rows that start no block zero the null block's fields.
                starting = ((pos % bs) == 0) & (meta.seq_lens > 0)
                self.zero_fields(layer, kv, torch.where(starting, phys, torch.full_like(phys, kv.null_block)))
            if generated:
                cache.decode(kv.k[layer], kv.v[layer], pos, PagedBlocks(meta.block_tables, kv.null_block), meta.seq_lens,
                             store, self.constants(layer, kv))
                return
            completing = ((pos % bs) == bs - 1) & (meta.seq_lens > 0)
            # Graph-safe: every row computes; rows that complete nothing write to the null block.
            target = torch.where(completing, phys, torch.full_like(phys, kv.null_block))
            self._run_cache(layer, kv, phys, target, fixed_shape=True)

    def _stateful(self, kv: KVCache) -> bool:
        if self._saves_state is None:
            self._saves_state = saves_state(self.flow, kv.head_dim)
        return self._saves_state

    def zero_fields(self, layer: int, kv: KVCache, blocks: torch.Tensor) -> None:
        for t in self._stores(layer, kv).values():
            t.index_fill_(0, blocks, 0)

    def rebuild_fields(self, layer: int, kv: KVCache, block_table: torch.Tensor, num_tokens: int) -> None:
        """Fields of a sequence whose KV was written outside this backend (a reuse prefill): the cache
        stage on its full blocks, zeros on its partial last block."""
        full = block_table[: num_tokens // kv.block_size].long()
        if num_tokens % kv.block_size:
            self.zero_fields(layer, kv, block_table[num_tokens // kv.block_size :][:1].long())
        if full.numel():
            self._run_cache(layer, kv, full, full)

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
        store = self._stores(layer, kv)
        if not store:
            return
        if self._generated_path(kv.k):
            cache = self._cache_kernel(kv)
            if cache is not None:
                cache(kv.k[layer], kv.v[layer], src, dst, store, self.constants(layer, kv))
                return
        # Prefill chunks vary in size (no point compiling each); decode's shapes are fixed.
        fn = self._cache_fn if fixed_shape else self._cache_tensors
        out = fn(kv.k[layer], kv.v[layer], src, self.constants(layer, kv))
        for name, f in out.items():
            store[name][dst] = f.to(store[name].dtype)

    # ---- indexer + sparse attention -----------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        with stage("indexer"):
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
            stores = self._stores(layer, kv)
            args = (q, meta.block_tables, meta.seq_lens, stores, kv.k[layer] if self.flow.uses_keys else None,
                    kv.num_kv_heads, kv.block_size, kv.null_block, self.constants(layer, kv))
            generated = self._generated_path(q)
            indexer = self._indexer_kernel(kv, q.shape[1] // kv.num_kv_heads) if generated else None
            if generated and not self._forced_only:  # scoring (generated, else compiled torch), radix select
                if indexer is not None:
                    score, counts = indexer(q, PagedBlocks(meta.block_tables, kv.null_block), meta.seq_lens, stores,
                                            args[4], args[8], kv.num_kv_heads, self.flow.budget_rule)
                    saved, table = {}, meta.block_tables
                else:
                    score, counts, saved, table = self._score_fn(*args)
                with stage("topk"):
                    blocks = self._top_blocks(score, counts, meta.seq_lens, kv.num_kv_heads, kv.block_size, select_topk)
            elif self._select_fn == self._select_tensors:  # reference: `_select_tensors` in its two steps,
                score, counts, saved, table = self._score_tensors(*args)  # so a profile sees the top-k apart
                with stage("topk"):
                    blocks = self._top_blocks(score, counts, meta.seq_lens, kv.num_kv_heads, kv.block_size, _torch_topk)
            else:  # CPU-compiled, or always-kept blocks only: one tensor function
                blocks, counts, saved, table = self._select_fn(*args)
            b = q.shape[0]
            blocks, counts = blocks.view(b, kv.num_kv_heads, -1), counts.view(b, kv.num_kv_heads)
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
        """Indexer + selection with torch.topk, as one tensor function (the reference, and what the
        compiled executor compiles where the generated kernels do not run)."""
        score, counts, saved, table = self._score_tensors(q, block_tables, seq_lens, stores, k_pool, h, bs, null_block, const)
        return self._top_blocks(score, counts, seq_lens, h, bs, _torch_topk), counts, saved, table

    def _top_blocks(
        self, score: torch.Tensor | None, counts: torch.Tensor, seq_lens: torch.Tensor, h: int, bs: int, topk
    ) -> torch.Tensor:
        """The selected blocks `[R, K]`: the first `counts[r]` entries of row r count."""
        flow = self.flow
        if score is None:
            # Only the always-kept blocks (StreamingLLM): their indices are arithmetic, no top-k.
            forced_n = flow.sink_blocks + flow.local_blocks
            nb = ((seq_lens.long() + bs - 1) // bs).repeat_interleave(h)
            k = torch.arange(forced_n, device=seq_lens.device)
            tail = nb[:, None] - forced_n + k  # the last local_blocks blocks
            return torch.where((nb[:, None] >= forced_n) & (k >= flow.sink_blocks), tail, k).to(torch.int32)
        width = score.shape[1]
        return topk(score, counts, min(width, flow.budget_blocks(width)))

    def _score_tensors(
        self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, h: int, bs: int, null_block: int, const: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The indexer over every (request, KV head) row, in float32 or wider. Returns the masked
        scores `[R, W]` (always-kept blocks +inf, blocks past the sequence -inf; None for a flow
        that keeps only those), the blocks each row attends `[R]`, the saved state values as
        `[B, W, Hkv, r, c]` and the block table they belong to (past each sequence: the null block)."""
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

        # Indexer math in float32 (float64 stays), as the generated kernels compute; a flow that
        # reads raw keys stays in the pool's dtype: its key GEMMs are its cost, and bf16 GEMMs
        # accumulate in fp32 anyway.
        wide = _wide if k_pool is None else (lambda t: t)
        fields = Fields(
            {
                name: FT(wide(store[table].permute(0, 2, 1, 3, 4).reshape(rows, width, *store.shape[2:])), valid)
                for name, store in stores.items()
            }
        )
        if k_pool is not None:
            # Raw keys [R, W, bs, D]; slots past the sequence end hold stale data: zero them.
            keys = k_pool[table].permute(0, 2, 1, 3, 4)  # [B, Hkv, W, bs, D]
            live = (idx[:, None] * bs + torch.arange(bs, device=q.device)) < seq_lens.long()[:, None, None]  # [B, W, bs]
            keys = keys * live[:, None, :, :, None].to(keys.dtype)
            dict.__setitem__(fields, "k", FT(keys.reshape(rows, width, bs, d), valid))
        const_ft = const_rows({n: wide(c) for n, c in const.items()}, b)
        sel = flow.run_index(FT(wide(q).reshape(rows, 1, hq // h, d)), fields, const_ft)
        forced_n = flow.sink_blocks + flow.local_blocks
        if sel.score is None:
            return None, torch.minimum(nb, torch.full_like(nb, forced_n)).to(torch.int32), {}, table
        score = sel.score.data.reshape(rows, width).float()
        rule = flow.budget_rule
        forced = (idx < rule.sink) | (idx >= nb[:, None] - rule.local)
        lowest = torch.finfo(torch.float32).min
        score = score.nan_to_num(nan=lowest, neginf=lowest, posinf=torch.finfo(torch.float32).max)
        score = score.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
        saved = {
            name: ft.data.reshape(b, h, width, *ft.shape[1:]).transpose(1, 2) for name, ft in fields.saved.items()
        }
        return score, rule.counts(nb).to(torch.int32), saved, table


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 or wider: bf16 products would reorder close blocks."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _torch_topk(score: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    return score.topk(k, dim=1).indices.to(torch.int32)  # forced (+inf) first, padding (-inf) last
