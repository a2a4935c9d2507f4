"""The code of a decode flow's stages, built once per kernel key and shared.

`FlowStages` holds what running a flow needs that does not depend on an engine: the generated
Triton kernels (indexer, cache stage), the torch stage functions (the reference) and their
torch.compile wrappers. It is cached by `DecodeFlow.kernel_key` (class and every param but the
runtime ones) and executor, so flows differing only in budget, sink or local blocks, dense or
select layers share one `FlowStages`: no new kernel, no new dynamo variant. The stage functions
read the budget rule from its device tensor (`BudgetRule.tensor`) and the selection width `k`
from their arguments, never from the flow object, whose runtime params they never see.
"""

from __future__ import annotations

import torch

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import BudgetRule, DecodeFlow, from_store
from sparsetune.flow.compile import CacheKernel, ForcedOnly, IndexerKernel, NotBlockLocal, build_cache, build_indexer
from sparsetune.flow.ops import FT, Fields
from sparsetune.flow.shapes import IndexTraits, index_traits

EXECUTORS = ("reference", "compiled")
# Variants dynamo may keep of one compiled stage function: every FlowStages and batch shape is one.
# Set on these calls only (dynamo's process-wide default of 8 stays for everyone else's code).
RECOMPILE_LIMIT = 256

_CACHE: dict[tuple, "FlowStages"] = {}


def flow_stages(flow: DecodeFlow, executor: str) -> "FlowStages":
    """The shared stages of `flow` for `executor` (built on first request)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}")
    key = (flow.kernel_key(), executor)
    if key not in _CACHE:
        _CACHE[key] = FlowStages(flow, executor)
    return _CACHE[key]


def _compile(fn):
    compiled = torch.compile(fn, dynamic=False)
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT)(
        compiled)


def unit_rows(pool: torch.Tensor, rows: torch.Tensor, unit: int) -> torch.Tensor:
    """The tokens of selection units `rows` (`page * U + u`: unit u of cache block `page`, U = block
    size / `unit`) of one layer's pool `[blocks, Hkv, block_size, D]` → `[*rows.shape, Hkv, unit, D]`
    (with U = 1, `pool[rows]`)."""
    per = pool.shape[2] // unit
    if per == 1:
        return pool[rows]
    return pool.unflatten(2, (per, unit))[rows // per, :, rows % per]


def const_rows(const: dict[str, torch.Tensor], n: int) -> dict[str, FT]:
    """Per-KV-head constants `[Hkv, r, c]` as flow tensors over `n * Hkv` rows ordered (n, head),
    the layout of the stages' rows (blocks x heads in the cache stage, requests x heads in the
    indexer). A view when n == 1 or Hkv == 1, else a small copy: (n, head) rows of a per-head
    constant are no strided view."""
    return {name: FT(c.expand(n, *c.shape).reshape(n * c.shape[0], 1, *c.shape[1:])) for name, c in const.items()}


class FlowStages:
    """The stages of one kernel key. `executor="reference"` runs them op by op in torch (the ground
    truth). `"compiled"` on GPU runs a generated Triton kernel per block-local stage (`flow.compile`)
    and the radix-select top-k, and hands other stages to torch.compile; on CPU it torch.compiles
    the same stage functions (C++)."""

    def __init__(self, flow: DecodeFlow, executor: str) -> None:
        self.flow = flow  # the flow the stages trace; only its kernel-key params are ever read
        self.executor = executor
        self.select_fn, self.score_fn, self.cache_fn = self.select_tensors, self.score_tensors, self.cache_tensors
        self.candidates_fn, self.chosen_units_fn = self.score_candidates, chosen_units
        if executor == "compiled":
            self.select_fn, self.score_fn, self.cache_fn, self.candidates_fn, self.chosen_units_fn = map(
                _compile, (self.select_fn, self.score_fn, self.cache_fn, self.candidates_fn, self.chosen_units_fn))
        # The generated kernels by (stage, shapes...), built on first use; None: not block-local.
        self.generated: dict[tuple, IndexerKernel | CacheKernel | None] = {}
        self.paths: dict[str, str] = {}  # stage -> how the compiled executor runs it (for reports)
        self._traits: dict[int, IndexTraits] = {}  # head_dim -> what the indexer does

    def indexer_kernel(self, group: int, head_dim: int, candidates: bool = False) -> IndexerKernel | None:
        """The generated indexer for these shapes (None: not block-local; the compiled torch indexer
        runs), built once per shape: engines of different models share these stages. `candidates`:
        the one over a list of units per row (a two-level flow's second level)."""
        key = ("candidates" if candidates else "index", group, head_dim)
        path = "index_units" if candidates else "index"  # a two-level flow's second level, reported apart
        if key not in self.generated:
            try:
                self.generated[key] = build_indexer(self.flow, group, head_dim, candidates=candidates)
                self.paths[path] = ("generated Triton kernel over the kept blocks' units" if candidates else
                                    "generated Triton kernel") + " + radix-select top-k"
            except ForcedOnly:
                self.generated[key] = None
                self.paths[path] = "torch.compile (always-kept blocks only: arithmetic, no top-k)"
            except NotBlockLocal as e:
                self.generated[key] = None
                self.paths[path] = f"torch.compile (not block-local: {e}) + radix-select top-k"
        return self.generated[key]  # type: ignore[return-value]

    def cache_kernel(self, head_dim: int) -> CacheKernel | None:
        """The generated cache stage for this head dimension (None: not block-local; the compiled
        torch stage runs), built once per head dimension."""
        key = ("cache", head_dim)
        if key not in self.generated:
            try:
                self.generated[key] = build_cache(self.flow, head_dim)
                self.paths["cache"] = "generated Triton kernel"
            except NotBlockLocal as e:
                self.generated[key] = None
                self.paths["cache"] = f"torch.compile (not block-local: {e})"
        return self.generated[key]  # type: ignore[return-value]

    def traits(self, head_dim: int) -> IndexTraits:
        """Whether the indexer saves state and whether it keeps only the always-kept blocks."""
        if head_dim not in self._traits:
            self._traits[head_dim] = index_traits(self.flow, head_dim, self.flow.const_dims(head_dim))
        return self._traits[head_dim]

    # ---- the torch stage functions (reference; what the compiled executor compiles) ----------------

    def cache_tensors(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, const: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The cache stage on the units `src` of one layer's pool (`unit_rows`) → field name → `[T, Hkv, r, c]`."""
        t, h, u, d = src.numel(), k_pool.shape[1], self.flow.unit, k_pool.shape[3]
        k, v = (FT(unit_rows(pool, src, u).reshape(t * h, 1, u, d)) for pool in (k_pool, v_pool))
        out = self.flow.run_cache(k, v, const_rows(const, t))
        return {name: ft.data.reshape(t, h, *ft.shape[1:]) for name, ft in out.items()}

    def select_tensors(
        self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, h: int, bs: int, null_block: int, const: dict[str, torch.Tensor],
        rule: torch.Tensor, k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Indexer + selection of `k` blocks per row with torch.topk, as one tensor function (the
        reference, and what the compiled executor compiles where the generated kernels do not run)."""
        score, counts, saved, table = self.score_tensors(q, block_tables, seq_lens, stores, k_pool, h, bs, null_block,
                                                         const, rule)
        return self.top_blocks(score, counts, seq_lens, h, bs, torch_topk, k, rule), counts, saved, table

    def top_blocks(
        self, score: torch.Tensor | None, counts: torch.Tensor, seq_lens: torch.Tensor, h: int, bs: int, topk, k: int,
        rule: torch.Tensor,
    ) -> torch.Tensor:
        """The selected blocks `[R, k]`: the first `counts[r]` entries of row r count."""
        if score is None:
            # Only the always-kept blocks (StreamingLLM; k = sink + local): arithmetic, no top-k.
            nb = ((seq_lens.long() + bs - 1) // bs).repeat_interleave(h)
            i = torch.arange(k, device=seq_lens.device)
            tail = nb[:, None] - k + i  # the last local blocks
            return torch.where((nb[:, None] >= k) & (i >= rule[0]), tail, i).to(torch.int32)
        return topk(score, counts, k)

    def score_tensors(
        self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, h: int, bs: int, null_block: int, const: dict[str, torch.Tensor],
        rule: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The indexer over every (request, KV head) row, in float32 or wider. `block_tables`, `bs` and
        `null_block` are those of the flow's selection units (`FlowAttention.unit_table`: the cache
        blocks themselves when the unit is the block). Returns the masked scores `[R, W]` (always-kept
        units +inf, units past the sequence -inf; None for a flow that keeps only those), the units
        each row attends `[R]`, the saved state values as `[B, W, Hkv, r, c]` and the unit table they
        belong to (past each sequence: the null unit)."""
        b, hq, d = q.shape
        rows = b * h
        width = block_tables.shape[1]
        nblocks = (seq_lens.long() + bs - 1) // bs  # [B]
        idx = torch.arange(width, device=q.device)
        # Table entries past a sequence's blocks are garbage: read the null block's fields instead.
        table = torch.where(idx < nblocks[:, None], block_tables.long(), null_block)
        nb = nblocks.repeat_interleave(h)  # [R]
        valid = idx < nb[:, None]  # [R, width]

        wide = _reader(q, k_pool)
        fields = Fields(
            {
                name: FT(wide(store[table].permute(0, 2, 1, 3, 4).reshape(rows, width, *store.shape[2:])), valid)
                for name, store in stores.items()
            }
        )
        if k_pool is not None:
            # Raw keys [R, W, bs, D]; slots past the sequence end hold stale data: zero them.
            keys = unit_rows(k_pool, table, bs).permute(0, 2, 1, 3, 4)  # [B, Hkv, W, bs, D]
            live = (idx[:, None] * bs + torch.arange(bs, device=q.device)) < seq_lens.long()[:, None, None]  # [B, W, bs]
            keys = keys * live[:, None, :, :, None].to(keys.dtype)
            dict.__setitem__(fields, "k", FT(keys.reshape(rows, width, bs, d), valid))
        const_ft = const_rows({n: wide(c) for n, c in const.items()}, b)
        sel = self.flow.run_index(FT(wide(q).reshape(rows, 1, hq // h, d)), fields, const_ft)
        if sel.score is None:
            return None, torch.minimum(nb, (rule[0] + rule[1]).long()).to(torch.int32), {}, table
        score = _masked(sel.score.data.reshape(rows, width), rule, idx, nb, valid)
        saved = {
            name: ft.data.reshape(b, h, width, *ft.shape[1:]).transpose(1, 2) for name, ft in fields.saved.items()
        }
        return score, BudgetRule.counts_of(rule, nb).to(torch.int32), saved, table

    def score_candidates(
        self, q: torch.Tensor, unit_table: torch.Tensor, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, h: int, bs: int, null_unit: int, const: dict[str, torch.Tensor],
        rule: torch.Tensor, candidates: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer over the units `candidates` `[R, C]` of each (request, KV head) row only (logical
        unit indices; -1: none), as `score_tensors` scores them (the second level of a two-level
        flow: the units of its chosen blocks, `candidate_units`). Returns the masked scores `[R, C]`
        and the units each row attends `[R]` (the budget rule over all of its units, capped at the
        live entries of its list)."""
        b, hq, d = q.shape
        rows = b * h
        nb = ((seq_lens.long() + bs - 1) // bs).repeat_interleave(h)  # [R] units of each row's sequence
        logical = candidates.long()
        valid = (logical >= 0) & (logical < nb[:, None])
        seq = torch.arange(rows, device=q.device) // h
        head = (torch.arange(rows, device=q.device) % h)[:, None]
        table = torch.where(valid, unit_table.long()[seq[:, None], logical.clamp(min=0, max=unit_table.shape[1] - 1)],
                            null_unit)  # [R, C] store rows
        wide = _reader(q, k_pool)
        fields = Fields({name: FT(wide(store[table, head]), valid) for name, store in stores.items()})
        if k_pool is not None:
            at = torch.arange(table.shape[1], device=q.device)
            keys = unit_rows(k_pool, table, bs)[torch.arange(rows, device=q.device)[:, None], at, head]  # [R, C, bs, D]
            live = (logical[:, :, None] * bs + torch.arange(bs, device=q.device)) < seq_lens.long()[seq][:, None, None]
            dict.__setitem__(fields, "k", FT(keys * live[..., None].to(keys.dtype), valid))
        sel = self.flow.run_index(FT(wide(q).reshape(rows, 1, hq // h, d)), fields,
                                  const_rows({n: wide(c) for n, c in const.items()}, b))
        if fields.saved or sel.score is None:
            raise SparsetuneError(f"flow {self.flow.name!r}: a two-level flow's indexer must score units and save no state")
        counts = torch.minimum(BudgetRule.counts_of(rule, nb), valid.sum(1))  # no more than the list holds
        return _masked(sel.score.data.reshape(rows, -1), rule, logical, nb, valid), counts.to(torch.int32)


def candidate_units(pages: torch.Tensor, kept: torch.Tensor, units: int) -> torch.Tensor:
    """The units a two-level flow's second level scores: entry `i * units + u` of row r is unit u of
    chosen block `pages[r, i]` (logical unit `pages[r, i] * units + u`), -1 for i >= kept[r].
    `pages` `[R, Kp]`, `kept` `[R]` → `[R, Kp * units]` (int64). The generated candidates kernel
    computes the same entries itself (`flow.compile.indexer`)."""
    cand = pages.long()[..., None] * units + torch.arange(units, device=pages.device)
    chosen = torch.arange(pages.shape[1], device=pages.device)[:, None] < kept.long()[:, None, None]
    return torch.where(chosen, cand, -1).flatten(1)


def chosen_units(pages: torch.Tensor, top: torch.Tensor, units: int) -> torch.Tensor:
    """The logical units of the entries `top` `[R, K]` a top-k chose from `candidate_units(pages, ..,
    units)` (entry `i * units + u`: unit u of block `pages[r, i]`), int32 (one fused kernel compiled)."""
    top = top.long()
    return (pages.long().gather(1, top // units) * units + top % units).to(torch.int32)


def _masked(score: torch.Tensor, rule: torch.Tensor, logical: torch.Tensor, nb: torch.Tensor,
            valid: torch.Tensor) -> torch.Tensor:
    """Scores as the top-k reads them: float32, NaN the lowest, always-kept units (`logical` of
    rows of `nb` units) +inf, entries not `valid` -inf."""
    lowest = torch.finfo(torch.float32).min
    score = score.float().nan_to_num(nan=lowest, neginf=lowest, posinf=torch.finfo(torch.float32).max)
    score = score.masked_fill(BudgetRule.forced_of(rule, logical, nb[:, None]), float("inf"))
    return score.masked_fill(~valid, float("-inf"))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32 or wider: bf16 products would reorder close blocks."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _reader(q: torch.Tensor, k_pool: torch.Tensor | None):
    """How the indexer's inputs (the query, fields, constants) are read for its math: in float32 or
    wider (`_wide`), as the generated kernels compute; for a flow that reads raw keys, in the pool's
    dtype (its key GEMMs are its cost, and bf16 GEMMs accumulate in fp32 anyway). 8-bit fields are
    widened to the query's or the keys' dtype first (exact)."""
    if k_pool is None:
        return lambda t: _wide(from_store(t, q.dtype))
    return lambda t: from_store(t, k_pool.dtype)


def torch_topk(score: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    return score.topk(k, dim=1).indices.to(torch.int32)  # forced (+inf) first, padding (-inf) last
