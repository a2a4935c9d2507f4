"""Executes a reuse flow's recompute plan: the engine side of `ReuseFlow`, as requests the engine's
scheduler runs (`ReuseRequest`, an `engine/rows.py` `PlannedPrefill`).

1. When the scheduler first reaches the request (`admit`), it has given the request the prefix-cache
   blocks its prompt starts with, if any (exact KV, shared: never written; their rows are computed
   only up to a selection layer, whose flow sees every token, and no segment inside them is
   needed). Every other reusable segment of its prompt is looked up in the segment cache and held; a miss gets blocks of its own and a fill
   (`SegmentFill`: a prefill of the segment alone at position 0, salted by its namespace), queued
   before the request and run in the scheduler's prefill steps like any prompt's rows. The
   request waits until its segments are filled.
2. In the step that runs it, each segment's KV is copied into the request's blocks (past its cached
   prefix), keys rotated from the segment's stored positions to its positions in this prompt
   (`kernels/rope_realign.py`);
   the segments are let go once the step is done.
3. The model runs a forward over the rows the flow's plan names (`ReusePlan`, a `Rows`; see
   `reuse/base.py`), packed with the step's other requests (`RowsBatch`): their fresh K/V
   overwrite the cached ones, and they attend over the whole prompt with an exact causal mask.
4. The last prompt token's logits give its first token; the request then decodes like any other.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from sparsetune.engine.rope import inv_frequencies
from sparsetune.engine.rows import PlannedPrefill, Rows
from sparsetune.engine.ranges import stage
from sparsetune.engine.sequence import SamplingParams, Sequence
from sparsetune.errors import SparsetuneError
from sparsetune.kernels import rope_realign
from sparsetune.reuse.base import LayerInputs, ReuseFlow, SelectionInputs
from sparsetune.reuse.parts import ReuseLayout, prefix_salt
from sparsetune.reuse.segment_cache import Segment, SegmentCache


@dataclass
class ReuseStats:
    """Per request: how much was reused and how much of a full prefill was computed."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0  # leading tokens whose exact KV came from the prefix cache (shared blocks)
    reused_tokens: int = 0  # tokens whose KV came from the segment cache (past the prefix)
    segment_hits: int = 0
    segment_misses: int = 0  # segments prefilled on their own first (cache-building work)
    stored_tokens: int = 0  # tokens of the segments found stored (hits)
    filled_tokens: int = 0  # tokens of the segments filled for it first (misses)
    recomputed_reused: int = 0  # reused tokens recomputed in the layers after the selection
    token_layers: int = 0  # Σ over layers of rows computed
    mlp_token_layers: int = 0  # Σ over layers of rows that ran the MLP (fewer with a sparse FFN)
    attention_pairs: int = 0  # Σ over layers and rows of the keys attended, averaged over query heads
    fresh_kv: int = 0  # Σ over layers of reused (token, KV head) pairs whose KV was recomputed
    num_kv_heads: int = 1
    head_paged_kv_fraction: float | None = None  # share of per-head KV a head-paged store would keep
    num_layers: int = 0
    seconds: float = 0.0  # its prefill step: the realign and the step's forward (fills ran in steps before)

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / max(1, self.prompt_tokens)

    @property
    def recompute_ratio(self) -> float:
        """Recomputed share of the reused tokens (in the layers after a selection)."""
        return self.recomputed_reused / max(1, self.reused_tokens)

    @property
    def compute_fraction(self) -> float:
        """Token-layers computed as a share of a full prefill's."""
        return self.token_layers / max(1, self.num_layers * self.prompt_tokens)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "prefix_tokens": self.prefix_tokens, "reused_tokens": self.reused_tokens,
            "reuse_ratio": round(self.reuse_ratio, 6), "recompute_ratio": round(self.recompute_ratio, 6),
            "compute_fraction": round(self.compute_fraction, 6), "segment_hits": self.segment_hits,
            "segment_misses": self.segment_misses, "stored_tokens": self.stored_tokens,
            "filled_tokens": self.filled_tokens, "seconds": self.seconds,
            "token_layers": self.token_layers, "mlp_token_layers": self.mlp_token_layers,
            "attention_pairs": self.attention_pairs,
            "mlp_fraction": round(self.mlp_token_layers / max(1, self.num_layers * self.prompt_tokens), 6),
            "fresh_kv_fraction": round(self.fresh_kv / max(1, self.num_layers * self.num_kv_heads * self.reused_tokens), 6),
            **({} if self.head_paged_kv_fraction is None
               else {"head_paged_kv_fraction": round(self.head_paged_kv_fraction, 6)}),
        }


class ReuseExecutor:
    """Bound to one engine's KV pool and segment cache (`config`: its `ModelConfig`); `request` makes
    one prompt's plan for the scheduler."""

    def __init__(self, config, kv, segments: SegmentCache) -> None:
        self.kv = kv
        self.segments = segments
        self.num_layers = config.num_hidden_layers
        self.scale = config.head_dim**-0.5
        self.inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(kv.k.device)

    # ---- segments ---------------------------------------------------------------------------------

    def lookup(self, layout: ReuseLayout, start: int = 0) -> tuple[list[Segment], list[Sequence], ReuseStats]:
        """The cached segment of each reusable span ending past `start` (`needed`), acquired; the fills
        of those it lacked (a miss is inserted: blocks taken, not yet filled); the hits and misses
        counted. Raises `SparsetuneError` (nothing held) when a miss finds no room."""
        found, fills, counts = [], [], ReuseStats()
        try:
            for span in needed(layout, start):
                ids = layout.token_ids[span.start : span.end]
                seg = self.segments.lookup(ids, span.namespace)
                if seg is None:
                    seg = self.segments.insert(ids, span.namespace, pinned=span.pin)
                if not seg.ready and not seg.filling:  # a miss (not being filled for another request already)
                    counts.segment_misses += 1
                    counts.filled_tokens += len(span)
                    fills.append(self.fill(seg, span.namespace))
                else:
                    counts.segment_hits += 1
                    counts.stored_tokens += len(span)
                    if span.pin and not seg.pinned:
                        self.segments.pin(seg)
                self.segments.acquire(seg)
                found.append(seg)
        except SparsetuneError:
            self.let_go(found, fills)
            raise
        return found, fills, counts

    def let_go(self, segs: list[Segment], fills: list[Sequence]) -> None:
        """Give back what a lookup took: its segments, then the fills it made that were not queued (a
        segment left unfilled and unheld is dropped)."""
        for seg in segs:
            self.segments.release(seg)
        for f in fills:
            f.plan.cancel()

    def fill(self, seg: Segment, namespace: str) -> Sequence:
        """The cache-building request that computes `seg`'s KV into its blocks (a prefill at position 0)."""
        self.segments.start_fill(seg)
        return Sequence(list(seg.token_ids), SamplingParams(max_tokens=1), block_table=list(seg.blocks),
                        cache_salt=prefix_salt(namespace), plan=SegmentFill(self, seg))

    def realign(self, layout: ReuseLayout, segs: list[Segment], block_table: torch.Tensor, rotate: bool,
                start: int = 0) -> None:
        """Copy each segment's KV (all layers) into the request at positions `start`.. (those before are
        its cached prefix: shared blocks); keys rotated by the position delta."""
        if not segs:
            return
        # Built on the host, moved in one copy: per segment small device ops and a blocking copy of its
        # block list left the GPU idle for ~2 ms before the first kernel at 9 segments (H100, #18).
        spans = [(span, seg, torch.arange(max(0, start - span.start), len(span)))
                 for span, seg in zip(needed(layout, start), segs)]
        src = torch.cat([self.kv.slots(torch.tensor(seg.blocks), local) for _, seg, local in spans])
        pos = torch.cat([local + span.start for span, _, local in spans])
        # Segments are stored from position 0, so the delta is the span's start.
        delta = torch.cat([torch.full((len(local),), span.start if rotate else 0) for span, _, local in spans])
        src, pos, delta = torch.stack([src, pos, delta]).to(self.kv.k.device)
        fn = rope_realign.realign_kv if self.kv.k.is_cuda else rope_realign.realign_kv_ref
        with stage("realign"):
            fn(self.kv.k, self.kv.v, src, self.kv.slots(block_table, pos), delta, self.inv_freq)

    def request(self, flow: ReuseFlow, layout: ReuseLayout) -> ReuseRequest:
        """The plan of one prompt with segments, for the scheduler (`Sequence.plan`)."""
        return ReuseRequest(self, flow, layout)


class SegmentFill(PlannedPrefill):
    """A stored segment's fill: every row of the segment at positions 0.. into the segment's blocks."""

    cache_only = True

    def __init__(self, ex: ReuseExecutor, seg: Segment) -> None:
        self.ex, self.seg = ex, seg

    def num_rows(self) -> int:
        return self.seg.num_tokens

    def rows(self, block_table: torch.Tensor) -> Rows:
        t = self.seg.num_tokens
        return Rows(self.ex.kv, block_table, t, torch.arange(t, device=block_table.device), self.ex.scale)

    def wanted(self) -> bool:
        return self.seg.refs > 0

    def done(self) -> None:
        self.ex.segments.mark_ready(self.seg)

    def cancel(self) -> None:
        self.ex.segments.unfill(self.seg)


class ReuseRequest(PlannedPrefill):
    """One prompt with segments as the scheduler runs it (see the module docstring); `stats` fill in as it runs."""

    def __init__(self, ex: ReuseExecutor, flow: ReuseFlow, layout: ReuseLayout) -> None:
        self.ex, self.flow, self.layout = ex, flow, layout
        self.stats = ReuseStats(prompt_tokens=layout.num_tokens, num_layers=ex.num_layers, num_kv_heads=ex.kv.num_kv_heads)
        self.segs: list[Segment] = []
        self.plan: ReusePlan | None = None
        self._counts = ReuseStats()
        self._t0 = 0.0
        self.num_cached = 0  # leading tokens in prefix-cache blocks (set at admission)

    def admit(self, num_cached: int = 0) -> list[Sequence] | None:
        self.num_cached = num_cached
        if not self.flow.reads_cache:
            return []
        try:
            self.segs, fills, self._counts = self.ex.lookup(self.layout, num_cached)
        except SparsetuneError:
            return None  # no room for its misses yet: the scheduler tries again after a step
        return fills

    def ready(self) -> bool:
        return all(seg.ready for seg in self.segs)

    def _reused(self, device) -> torch.Tensor:
        return reused_tokens(self.flow, self.layout, device)

    @functools.cached_property
    def _num_rows(self) -> int:  # asked once admitted
        return int(first_rows(self.flow, self.layout, self._reused("cpu"), self.ex.num_layers, self.num_cached)[0].sum())

    def num_rows(self) -> int:  # asked at every scheduling pass it waits through: computed once
        return self._num_rows

    def rows(self, block_table: torch.Tensor) -> Rows:
        self._t0 = time.perf_counter()
        self.ex.realign(self.layout, self.segs, block_table, self.flow.realign, self.num_cached)
        s, counts = self.stats, self._counts
        s.segment_hits, s.segment_misses = counts.segment_hits, counts.segment_misses
        s.stored_tokens, s.filled_tokens = counts.stored_tokens, counts.filled_tokens
        s.prefix_tokens = self.num_cached
        reused = self._reused(self.ex.kv.k.device)
        s.head_paged_kv_fraction = self.flow.head_paged_kv_fraction(self.layout)
        self.plan = ReusePlan(self.ex.kv, block_table, self.flow, self.layout, reused, s, self.ex.num_layers,
                              self.ex.scale, self.num_cached)
        s.reused_tokens = int(self.plan.from_segments.sum())
        return self.plan

    def done(self) -> None:
        """After its step (its first token sampled): the plan's counters, and the step's time."""
        assert self.plan is not None
        self.plan.finish()
        self.stats.seconds = time.perf_counter() - self._t0
        self.cancel()  # its segments are copied: they go back to the cache
        self.ex.segments.enforce_watermark()  # idle segments above the watermark go, pinned ones last

    def cancel(self) -> None:
        self.ex.let_go(self.segs, [])
        self.segs = []


def reused_tokens(flow: ReuseFlow, layout: ReuseLayout, device) -> torch.Tensor:
    """`[T]` bool: the tokens of reusable segments, as the flow sees them (those in a cached prefix too:
    a prefix hit changes what is computed, not what the flow is asked); none for a flow that never
    reads cached KV (full recompute)."""
    if not flow.reads_cache:
        return torch.zeros(layout.num_tokens, dtype=torch.bool, device=device)
    return layout.reused_mask(device)


def needed(layout: ReuseLayout, start: int) -> list:
    """The reusable spans a prompt whose first `start` tokens are a cached prefix takes from the segment cache."""
    return [span for span in layout.segments if span.end > start]


def first_rows(flow: ReuseFlow, layout: ReuseLayout, reused: torch.Tensor, num_layers: int,
               num_cached: int = 0) -> tuple[torch.Tensor, int | None]:
    """A plan's rows computed from layer 0 (`[T]` bool) and its selection layer (None: a static plan,
    or nothing reused): the flow's initial rows, every token not reused and the last one (its logits
    give the first output token), but none of the cached prefix (its first `num_cached` tokens);
    every token when a selection layer needs them all up to it."""
    sel = None
    if not bool(reused[num_cached:].any()):  # nothing reused past the cached prefix: the rest is computed
        rows = torch.ones(layout.num_tokens, dtype=torch.bool, device=reused.device)
    else:
        sel = flow.selection_layer(num_layers)
        rows = flow.initial_rows(layout).to(reused.device) | ~reused
        if sel is not None:  # every token is computed up to and at the selection layer
            rows[:] = True
    if sel is None:
        rows[:num_cached] = False
    rows[-1] = True
    return rows, sel


class ReusePlan(Rows):
    """A reuse flow's recompute plan for one prompt, as the rows of the model's forward: the rows
    computed from layer 0, the selection at the selection layer, the (row, KV head) pairs that keep
    cached KV, per-head attention patterns and the MLP's rows; counts into `stats` (device counters,
    read once by `finish`: no host sync per layer). The first `num_cached` tokens are a cached prefix:
    computed up to the selection layer only (the flow's selection sees every token, and reused ones
    as reused), their fresh KV stored to the null slot (their blocks are shared: never written)."""

    def __init__(self, kv, block_table: torch.Tensor, flow: ReuseFlow, layout: ReuseLayout, reused: torch.Tensor,
                 stats: ReuseStats, num_layers: int, scale: float, num_cached: int = 0) -> None:
        dev, t = kv.k.device, layout.num_tokens
        self.flow, self.layout, self.reused, self.stats, self.num_layers = flow, layout, reused, stats, num_layers
        self.num_cached = num_cached
        self.from_segments = reused.clone()  # the reused tokens whose KV came from the segment cache
        self.from_segments[:num_cached] = False
        rows, self.sel_layer = first_rows(flow, layout, reused, num_layers, num_cached)
        self.recomputed = rows  # [T]: the rows after the selection layer (or of every layer)
        self.fresh = torch.zeros((), dtype=torch.long, device=dev)
        self.mlp_count = torch.zeros((), dtype=torch.long, device=dev)
        self.mlp_mask: torch.Tensor | None = None
        super().__init__(kv, block_table, t, rows.nonzero().squeeze(1), scale)

    def set_rows(self, positions: torch.Tensor) -> None:
        super().set_rows(positions)
        self.row_reused = self.from_segments[positions]
        if self.num_cached:  # the cached prefix's rows store nowhere: their blocks are shared
            self.row_slots = torch.where(positions < self.num_cached, self.kv.null_slot, self.row_slots)

    def continuing(self, layer, q, k, v):
        if layer != self.sel_layer:
            return None
        kc, vc = self.kv.read(layer, self.slots)  # the realigned cached KV `[T, Hkv, D]`, read before the fresh KV lands
        inputs = SelectionInputs(self.layout, layer, self.reused, q, k, v, kc, vc, self.scale)
        with stage("indexer"):
            chosen = self.flow.select(inputs).to(self.reused.device)
        # The flow's choice among reused tokens, plus every non-reused token and the last one.
        keep = (chosen & self.reused) | ~self.reused
        keep[: self.num_cached] = False
        keep[-1] = True
        self.recomputed = keep
        return keep[self.positions].nonzero().squeeze(1)

    def keep_cached(self, layer):
        cached = self.flow.keep_cached(layer, self.num_layers, self.positions, self.layout, self.reused)
        if cached is not None:  # only reused tokens have cached KV to keep
            cached = cached.to(self.reused.device) & self.row_reused[:, None]
        r = self.row_reused
        self.fresh += r.sum() * self.kv.num_kv_heads - (0 if cached is None else cached[r].sum())
        return cached

    def attention_pattern(self, layer, q, keys):
        s = LayerInputs(self.layout, layer, self.num_layers, self.reused, self.positions, q,
                        lambda: keys().transpose(0, 1), self.scale)
        pattern, self.mlp_mask = self.flow.attention_pattern(s), self.flow.mlp_rows(s)
        return pattern

    def mlp_rows(self, layer):
        m = self.mlp_mask
        self.stats.token_layers += self.positions.numel()
        self.mlp_count += self.positions.numel() if m is None else m.sum()
        return m

    def finish(self) -> None:
        """Read the device counters into the stats."""
        self.stats.fresh_kv, self.stats.mlp_token_layers = int(self.fresh), int(self.mlp_count)
        self.stats.attention_pairs = round(float(self.attention_pairs))
        self.stats.recomputed_reused = int((self.recomputed & self.from_segments).sum())
