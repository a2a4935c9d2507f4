"""Running a decode flow inside the engine: `FlowAttention`, an `AttentionBackend`.

On KV write it runs the flow's cache stage for every selection unit the write completes and stores
the fields per physical unit. On decode it gathers the fields of each sequence's units, runs the
indexer per (request, KV head) row, applies the always-kept units and the budget, takes an exact
top-k on device, and attends over the selected units with the sparse paged kernel. A unit is a KV
block, or with `select_block` a smaller piece of one: unit u of cache block p is row `p * U + u` of
the field stores (U units a block; `unit_table` maps a block table to its units). Decode reads
tensors only (no host values), so the whole step, indexer included, is captured in the engine's
CUDA graphs. A calibrated flow's per-layer constants (`const`) are tensors passed into the stage
functions like the pool, so the compiled executor sees them as inputs, not as captured attributes.

The stages' code is `FlowStages`, shared by every flow with the same kernel key; this backend
holds one engine's state (field stores, constants, the budget rule's device tensor). `retune`
swaps in a flow of the same kernel key: the rule tensor is rewritten in place, so compiled
kernels and captured graphs stay valid unless the selection width changes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.ranges import stage
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import FP8, DecodeFlow, to_store
from sparsetune.flow.compile import PagedBlocks
from sparsetune.flow.stages import EXECUTORS, FlowStages, candidate_units, flow_stages, torch_topk
from sparsetune.flow.shapes import field_dims
from sparsetune.kernels import paged_decode
from sparsetune.kernels.select_topk import select_topk

__all__ = ["EXECUTORS", "FlowAttention", "channel_selector"]


def channel_selector(order: Sequence[Sequence[int]], channels: int) -> torch.Tensor:
    """A calibrated flow's constant "channels" for one layer, `[Hkv, channels, D]` (float32): row i
    is one-hot at the i-th most important channel of the KV head (`order`: per head, best first)."""
    idx = torch.tensor(order, dtype=torch.long)
    d = idx.shape[1]
    if channels > d:
        raise SparsetuneError(f"--param channels={channels}: the model's heads have {d} channels; pick at most {d}")
    return torch.nn.functional.one_hot(idx[:, :channels], d).float()


class FlowAttention(DenseAttention):
    """Executes a decode flow with the stages of `executor` (`FlowStages`)."""

    name = "flow"

    def __init__(
        self, flow: DecodeFlow, scale: float, use_triton: bool | None = None, executor: str = "reference",
        calibration: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """`calibration`: a calibrated flow's channel order per layer and KV head, most important
        first (`models.artifacts.resolve_calibration`)."""
        super().__init__(scale, use_triton)
        if flow.calibrated and calibration is None:
            raise ValueError(f"flow {flow.name!r} is calibrated: pass its channel calibration")
        self.flow = flow
        self.stages: FlowStages = flow_stages(flow, executor)
        # Built (and `channels` checked against head_dim) now, on the host; moved to the pool's
        # device and dtype on first use, as the field stores are created (the engine's warm-up
        # step before graph capture is eager).
        self._selectors = [channel_selector(order, flow.channels) for order in calibration] if flow.calibrated else []
        self._const: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [Hkv, r, c]
        self._rule: torch.Tensor | None = None  # the budget rule on the pool's device (`rule`)
        self.name = flow.name
        self.executor = executor
        self.units = flow.block_size // flow.unit  # selection units per KV block (U)
        page = flow.page_flow()  # two-level: the first level, over whole blocks, runs as a backend of its own
        self.pages = None if page is None else FlowAttention(page, scale, use_triton, executor, calibration)
        if page is not None:
            from sparsetune.flow.compile import why_not

            why = why_not(flow)["index"]
            if why is not None:  # its second level scores a list of candidate units, not the sequence
                raise SparsetuneError(f"--param coarse: flow {flow.name!r} cannot select in two levels: its indexer "
                                      f"does not score each unit on its own ({why}); drop coarse")
        self.fields: dict[int, dict[str, torch.Tensor]] = {}  # layer -> field -> [(blocks + 1) * U, Hkv, r, c]
        self.last_selection: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (blocks, counts)
        # The latest selection of this step, reused by layers outside `select_layers` (TidalDecode).
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def paths(self) -> dict[str, str]:
        """Stage -> how the compiled executor runs it (for reports)."""
        return self.stages.paths

    def serves(self, flow: DecodeFlow) -> bool:
        """Whether `retune` can move this backend to `flow`: the same kernel key and as many levels
        (`coarse` is a runtime param, but a first level is a backend of its own)."""
        return flow.kernel_key() == self.flow.kernel_key() and (flow.coarse is None) == (self.pages is None)

    def retune(self, flow: DecodeFlow) -> None:
        """Run `flow`, of this backend's kernel key, from now on: its budget rule is written into the
        same device tensor (captured graphs read the new values); stores and kernels are kept."""
        if not self.serves(flow):
            raise ValueError(f"retune needs a flow of the same kernel key and levels as {self.flow.name!r}")
        self.flow, self.name = flow, flow.name
        if self.pages is not None:
            self.pages.retune(flow.page_flow())
        if self._rule is not None:
            with torch.inference_mode():  # created inside the engine's steps: an inference tensor
                self._rule.copy_(flow.budget_rule.tensor())
        for layer in flow.dense_layers:  # fields of layers that no longer select
            self.fields.pop(layer, None)

    def rule(self, device: torch.device) -> torch.Tensor:
        """The budget rule's device tensor (created on first use, then only ever written in place)."""
        if self._rule is None:
            self._rule = self.flow.budget_rule.tensor(device)
        return self._rule

    def selection_width(self, width: int, head_dim: int) -> int:
        """Units per row of a selection over a block table `width` blocks wide: a shape of the
        step (a captured graph holds it; a flow that changes it needs new graphs)."""
        units = self.flow.attended_blocks(width * self.units, scores=not self.stages.traits(head_dim).forced_only)
        if self.pages is not None:  # no more than the chosen blocks hold
            units = min(units, self.pages.selection_width(width, head_dim) * self.units)
        return units

    def selection_shape(self, width: int, head_dim: int) -> tuple[int, ...]:
        """Every selection width a step's graphs hold: the units', and a two-level flow's blocks'."""
        first = () if self.pages is None else (self.pages.selection_width(width, head_dim),)
        return (self.selection_width(width, head_dim), *first)

    def _generated_path(self, x: torch.Tensor) -> bool:
        """The compiled executor on the Triton path runs sparsetune's own kernels: the generated
        stages where they are block-local, the radix-select top-k always."""
        return self.executor == "compiled" and self.triton_path(x)

    def unit_table(self, block_tables: torch.Tensor) -> torch.Tensor:
        """The store rows of each sequence's selection units, in order `[B, W * U]` (the table itself
        when a unit is the block)."""
        if self.units == 1:
            return block_tables
        u = torch.arange(self.units, device=block_tables.device, dtype=block_tables.dtype)
        return (block_tables[:, :, None] * self.units + u).flatten(1)

    def stores(self, layer: int, kv: KVCache) -> dict[str, torch.Tensor]:
        """Layer's field stores, `[(blocks + 1) * U, Hkv, r, c]` each (the last block's units are the null block's)."""
        store = self.fields.get(layer)
        if store is None:
            dims = field_dims(self.flow, kv.head_dim)
            rows = (kv.num_blocks + 1) * self.units
            store = self.fields[layer] = {
                name: torch.zeros(rows, kv.num_kv_heads, *rc, dtype=self.flow.store_dtype(kv.k.dtype), device=kv.k.device)
                for name, rc in dims.items()
            }
        return store

    # ---- cache stage ------------------------------------------------------------------------------

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> None:
        super().write_kv(layer, k, v, kv, meta)
        with stage("cache_stage"):
            self.write_fields(layer, kv, meta)

    def write_fields(self, layer: int, kv: KVCache, meta: AttentionMetadata) -> None:
        """The cache stage for the units this step's KV write completed. A unit the write starts but
        does not complete gets zero fields: it may hold a previous owner's (a flow's state included)."""
        bs = self.flow.unit
        if self.pages is not None:  # a two-level flow's blocks keep fields of their own
            self.pages.write_fields(layer, kv, meta)
        if meta.is_prefill:
            # Units completed by this chunk: b with ctx <= (b+1)*bs - 1 < seq_len.
            done, open_ = [], []
            table = self.unit_table(meta.block_tables)
            for i in range(meta.batch_size):
                ctx, end = meta.context_len(i), meta.seq_lens_cpu[i]
                done.append(table[i, ctx // bs : end // bs])
                if end % bs and end // bs >= ctx // bs:
                    open_.append(table[i, end // bs : end // bs + 1])
            if open_:
                self.zero_fields(layer, kv, torch.cat(open_).long())
            blocks = torch.cat(done).long()
            if blocks.numel():
                self.run_cache(layer, kv, blocks, blocks)
        else:
            pos = meta.positions
            cache = self.stages.cache_kernel(kv.head_dim) if self._generated_path(kv.k) else None
            store = self.stores(layer, kv)
            generated, stateful = cache is not None and bool(store), self.stages.traits(kv.head_dim).saves_state
            if stateful or not generated:  # the generated stage finds the blocks itself
                phys = self.unit_table(meta.block_tables).gather(1, (pos // bs).view(-1, 1)).view(-1).long()
            if stateful:  # a stateless flow never reads the open block's fields (always kept)
                # Graph-safe: rows that start no block zero the null block's fields.
                starting = ((pos % bs) == 0) & (meta.seq_lens > 0)
                self.zero_fields(layer, kv, torch.where(starting, phys, torch.full_like(phys, self.null_unit(kv))))
            if generated:
                cache.decode(kv.k[layer], kv.v[layer], pos, PagedBlocks(meta.block_tables, kv.null_block), meta.seq_lens,
                             store, self.constants(layer, kv))
                return
            completing = ((pos % bs) == bs - 1) & (meta.seq_lens > 0)
            # Graph-safe: every row computes; rows that complete nothing write to the null block.
            target = torch.where(completing, phys, torch.full_like(phys, self.null_unit(kv)))
            self.run_cache(layer, kv, phys, target, fixed_shape=True)

    def null_unit(self, kv: KVCache) -> int:
        """The store row that writes nobody reads land in (the null block's first unit)."""
        return kv.null_block * self.units

    def zero_fields(self, layer: int, kv: KVCache, units: torch.Tensor) -> None:
        for t in self.stores(layer, kv).values():  # an 8-bit store's zero is the zero byte (no fp8 fill on CPU)
            (t.view(torch.uint8) if t.dtype == FP8 else t).index_fill_(0, units, 0)

    def rebuild_fields(self, layer: int, kv: KVCache, block_table: torch.Tensor, num_tokens: int) -> None:
        """Fields of a sequence whose KV was written outside this backend (a reuse prefill): the cache
        stage on its full units, zeros on its partial last unit."""
        bs, table = self.flow.unit, self.unit_table(block_table[None])[0]
        full = table[: num_tokens // bs].long()
        if num_tokens % bs:
            self.zero_fields(layer, kv, table[num_tokens // bs :][:1].long())
        if full.numel():
            self.run_cache(layer, kv, full, full)
        if self.pages is not None:
            self.pages.rebuild_fields(layer, kv, block_table, num_tokens)

    def constants(self, layer: int, kv: KVCache) -> dict[str, torch.Tensor]:
        """The flow's constants of `layer` (name → `[Hkv, r, c]`), in the pool's dtype and device."""
        if not self.flow.calibrated:
            return {}
        const = self._const.get(layer)
        if const is None:
            const = self._const[layer] = {"channels": self._selectors[layer].to(kv.k.device, kv.k.dtype)}
        return const

    def run_cache(self, layer: int, kv: KVCache, src: torch.Tensor, dst: torch.Tensor, fixed_shape: bool = False) -> None:
        store = self.stores(layer, kv)
        if not store:
            return
        if self._generated_path(kv.k):
            cache = self.stages.cache_kernel(kv.head_dim)
            if cache is not None:
                cache(kv.k[layer], kv.v[layer], src, dst, store, self.constants(layer, kv))
                return
        # Prefill chunks vary in size (no point compiling each); decode's shapes are fixed.
        fn = self.stages.cache_fn if fixed_shape else self.stages.cache_tensors
        out = fn(kv.k[layer], kv.v[layer], src, self.constants(layer, kv))
        for name, f in out.items():
            store[name][dst] = to_store(f, store[name].dtype)

    # ---- indexer + sparse attention -----------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        with stage("indexer"):
            blocks, counts = self.select(layer, q, kv, meta)
        sparse = paged_decode.sparse_paged_decode_attention
        fn = sparse if self.triton_path(q) else paged_decode.sparse_paged_decode_attention_ref
        return fn(q, kv.k[layer], kv.v[layer], meta.block_tables, meta.seq_lens, blocks, counts, self.scale,
                  unit=self.flow.unit)

    def select(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected logical units `[B, Hkv, K]` and how many of them count `[B, Hkv]`."""
        reuse = self.flow.select_layers and layer not in self.flow.select_layers
        if reuse:
            if self._shared is None:
                raise RuntimeError(f"layer {layer} reuses a selection but no select layer ran before it")
            blocks, counts = self._shared
        elif self.pages is not None:
            blocks, counts = self._select_in_blocks(layer, q, kv, meta)
            self._shared = (blocks, counts)
        else:
            st, h, bs = self.stages, kv.num_kv_heads, self.flow.unit
            stores, rule = self.stores(layer, kv), self.rule(q.device)
            args = (q, self.unit_table(meta.block_tables), meta.seq_lens, stores,
                    kv.k[layer] if self.flow.uses_keys else None, h, bs, self.null_unit(kv), self.constants(layer, kv),
                    rule)
            generated = self._generated_path(q)
            indexer = st.indexer_kernel(q.shape[1] // h, kv.head_dim) if generated else None
            k = self.selection_width(meta.block_tables.shape[1], kv.head_dim)  # units
            if generated and not st.traits(kv.head_dim).forced_only:  # scoring (generated, else compiled torch), radix select
                if indexer is not None:
                    score, counts = indexer(q, PagedBlocks(meta.block_tables, kv.null_block), meta.seq_lens, stores,
                                            args[4], args[8], h, rule)
                    saved, table = {}, meta.block_tables
                else:
                    score, counts, saved, table = st.score_fn(*args)
                with stage("topk"):
                    blocks = st.top_blocks(score, counts, meta.seq_lens, h, bs, select_topk, k, rule)
            elif st.select_fn == st.select_tensors:  # reference: `select_tensors` in its two steps,
                score, counts, saved, table = st.score_tensors(*args)  # so a profile sees the top-k apart
                with stage("topk"):
                    blocks = st.top_blocks(score, counts, meta.seq_lens, h, bs, torch_topk, k, rule)
            else:  # CPU-compiled, or always-kept blocks only: one tensor function
                blocks, counts, saved, table = st.select_fn(*args, k)
            b = q.shape[0]
            blocks, counts = blocks.view(b, h, -1), counts.view(b, h)
            for name, value in saved.items():  # state for the next step; padding lands in the null block
                stores[name][table] = to_store(value, stores[name].dtype)
            self._shared = (blocks, counts)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # kept for inspection, eager only
            self.last_selection[layer] = (blocks, counts)
        return blocks, counts

    def _select_in_blocks(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two-level selection: the first level's blocks, then the best units among theirs (its
        always-kept blocks hold every always-kept unit, so those are among them)."""
        pages, kept = self.pages.select(layer, q, kv, meta)  # [B, Hkv, Kp], [B, Hkv]
        b, h, kp = pages.shape
        u = self.units
        pages, kept = pages.view(b * h, kp), kept.view(b * h)
        generated = self._generated_path(q)
        kernel = self.stages.indexer_kernel(q.shape[1] // h, kv.head_dim, candidates=True) if generated else None
        stores, keys, consts, rule = (self.stores(layer, kv), kv.k[layer] if self.flow.uses_keys else None,
                                      self.constants(layer, kv), self.rule(q.device))
        if kernel is not None:  # the kernel lists the chosen blocks' units itself
            score, counts = kernel(q, PagedBlocks(meta.block_tables, kv.null_block), meta.seq_lens, stores, keys, consts,
                                   h, rule, pages=(pages, kept))
        else:
            score, counts = self.stages.candidates_fn(q, self.unit_table(meta.block_tables), meta.seq_lens, stores, keys, h,
                                                      self.flow.unit, self.null_unit(kv), consts, rule,
                                                      candidate_units(pages, kept, u))
        k = self.selection_width(meta.block_tables.shape[1], kv.head_dim)
        with stage("topk"):
            top = (select_topk if generated else torch_topk)(score, counts, k)  # entries i * U + u
        units = self.stages.chosen_units_fn(pages, top, u)
        return units.view(b, h, -1), counts.view(b, h)
