"""Executes a reuse flow's recompute plan for one request: the engine side of `ReuseFlow`.

1. Every reusable segment of the prompt is looked up in the segment cache; a miss is prefilled on
   its own at position 0 (as a cache-building request would) into blocks the cache owns.
2. Each segment's KV is copied into the request's blocks, keys rotated from the segment's stored
   positions to its positions in this prompt (`kernels/rope_realign.py`).
3. The layer loop runs only the rows the flow's plan names (see `reuse/flow.py`): their fresh K/V
   overwrite the cached ones, and they attend over the whole prompt with an exact causal mask.
4. The last prompt token's logits come back; the request then decodes like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparsetune.engine.rope import inv_frequencies
from sparsetune.engine.rows import CausalRuns, attend_causal, attend_pattern
from sparsetune.engine.stages import stage
from sparsetune.kernels import rope_realign
from sparsetune.reuse.flow import LayerInputs, ReuseFlow, SelectionInputs
from sparsetune.reuse.parts import ReuseLayout
from sparsetune.reuse.segment_cache import Segment, SegmentCache


@dataclass
class ReuseStats:
    """Per request: how much was reused and how much of a full prefill was computed."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # tokens whose KV came from the segment cache
    segment_hits: int = 0
    segment_misses: int = 0  # segments prefilled on their own first (cache-building work)
    recomputed_reused: int = 0  # reused tokens recomputed in the layers after the selection
    token_layers: int = 0  # Σ over layers of rows computed
    mlp_token_layers: int = 0  # Σ over layers of rows that ran the MLP (fewer with a sparse FFN)
    fresh_kv: int = 0  # Σ over layers of reused (token, KV head) pairs whose KV was recomputed
    num_kv_heads: int = 1
    head_paged_kv_fraction: float | None = None  # share of per-head KV a head-paged store would keep
    num_layers: int = 0
    seconds: float = 0.0  # the whole reuse prefill, segment misses included

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
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "reuse_ratio": round(self.reuse_ratio, 6), "recompute_ratio": round(self.recompute_ratio, 6),
            "compute_fraction": round(self.compute_fraction, 6), "segment_hits": self.segment_hits,
            "segment_misses": self.segment_misses, "seconds": self.seconds,
            "mlp_fraction": round(self.mlp_token_layers / max(1, self.num_layers * self.prompt_tokens), 6),
            "fresh_kv_fraction": round(self.fresh_kv / max(1, self.num_layers * self.num_kv_heads * self.reused_tokens), 6),
            **({} if self.head_paged_kv_fraction is None
               else {"head_paged_kv_fraction": round(self.head_paged_kv_fraction, 6)}),
        }


class ReuseExecutor:
    """Bound to one engine's model and KV pool; `prefill` runs one request's plan."""

    def __init__(self, model, kv, segments: SegmentCache, rope_scaling, rope_theta: float) -> None:
        self.model = model
        self.kv = kv
        self.segments = segments
        cfg = model.config
        self.scale = cfg.head_dim**-0.5
        self.inv_freq = inv_frequencies(cfg.head_dim, rope_theta, rope_scaling).to(kv.k.device)

    # ---- segments ---------------------------------------------------------------------------------

    def fetch_segments(self, layout: ReuseLayout, stats: ReuseStats) -> list[Segment]:
        """The cached segment of each reusable span (prefilling and storing the misses); acquired."""
        found = []
        for span in layout.segments:
            ids = layout.token_ids[span.start : span.end]
            seg = self.segments.lookup(ids, span.namespace)
            if seg is None:
                stats.segment_misses += 1
                seg = self.segments.insert(ids, span.namespace, pinned=span.pin)
                try:
                    self.forward(ids, torch.tensor(seg.blocks, device=self.kv.k.device), None, None, stats=None)
                except BaseException:
                    self.segments.drop(seg)
                    raise
                self.segments.mark_ready(seg)
            else:
                stats.segment_hits += 1
                if span.pin and not seg.pinned:
                    self.segments.pin(seg)
            self.segments.acquire(seg)
            found.append(seg)
        return found

    def realign(self, layout: ReuseLayout, segs: list[Segment], block_table: torch.Tensor, rotate: bool) -> None:
        """Copy each segment's KV (all layers) into the request; keys rotated by the position delta."""
        if not segs:
            return
        dev = self.kv.k.device
        src, dst, delta = [], [], []
        for span, seg in zip(layout.segments, segs):
            n = len(span)
            local = torch.arange(n, device=dev)
            src.append(self.kv.slots(torch.tensor(seg.blocks, device=dev), local))
            dst.append(self.kv.slots(block_table, local + span.start))
            # Segments are stored from position 0, so the delta is the span's start.
            delta.append(torch.full((n,), span.start if rotate else 0, dtype=torch.long, device=dev))
        fn = rope_realign.realign_kv if self.kv.k.is_cuda else rope_realign.realign_kv_ref
        with stage("kv_store"):
            fn(self.kv.k, self.kv.v, torch.cat(src), torch.cat(dst), torch.cat(delta), self.inv_freq)

    # ---- the layer loop ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, flow: ReuseFlow, layout: ReuseLayout, block_table: torch.Tensor) -> tuple[torch.Tensor, ReuseStats]:
        """Fill the request's blocks with the prompt's KV by the flow's plan → (last-token logits `[V]`, stats)."""
        t0 = time.perf_counter()
        stats = ReuseStats(prompt_tokens=layout.num_tokens, num_layers=len(self.model.model.layers),
                           num_kv_heads=self.kv.num_kv_heads)
        segs = self.fetch_segments(layout, stats) if flow.reads_cache else []
        try:
            self.realign(layout, segs, block_table, flow.realign)
        finally:
            for seg in segs:
                self.segments.release(seg)
        dev = self.kv.k.device
        reused = layout.reused_mask(dev) if flow.reads_cache else torch.zeros(layout.num_tokens, dtype=torch.bool, device=dev)
        stats.reused_tokens = int(reused.sum())
        stats.head_paged_kv_fraction = flow.head_paged_kv_fraction(layout)
        hidden = self.forward(layout.token_ids, block_table, flow, layout, stats, reused)
        logits = self.model.compute_logits(hidden[-1:])[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stats.seconds = time.perf_counter() - t0
        return logits, stats

    @torch.inference_mode()
    def forward(self, token_ids: list[int], block_table: torch.Tensor, flow: ReuseFlow | None,
                layout: ReuseLayout | None, stats: ReuseStats | None, reused: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layers over the plan's rows (every row when `flow` is None: a plain prefill);
        returns the final hidden state of the last row computed (always the last token)."""
        model, kv = self.model, self.kv
        dev, t = kv.k.device, len(token_ids)
        ids = torch.tensor(token_ids, device=dev)
        slots = kv.slots(block_table, torch.arange(t, device=dev))
        num_layers = len(model.model.layers)
        sel_layer = None
        if flow is None or reused is None or not bool(reused.any()):
            rows = torch.ones(t, dtype=torch.bool, device=dev)
        else:
            sel_layer = flow.selection_layer(num_layers)
            rows = flow.initial_rows(layout).to(dev) | ~reused
            if sel_layer is not None:  # every token is computed up to and at the selection layer
                rows[:] = True
        rows[-1] = True  # the first output token is read from the last prompt token
        idx = rows.nonzero().squeeze(1)
        plan = CausalRuns.of(idx)
        h, res = model.model.embed_tokens(ids[idx]), None
        fresh, mlp_rows = torch.zeros((), dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev)
        for li, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            if res is None:
                res, x = h, layer.input_layernorm(h)
            else:
                x, res = layer.input_layernorm(h, res)
            q, k, v = attn.qkv(x, idx, model.cos_sin)
            if li == sel_layer:  # fresh q/k/v; reads the cached KV before this layer's store overwrites it
                keep = self._select(flow, layout, li, reused, q, k, v, slots)
            cached = None
            if flow is not None and reused is not None:  # (row, head) pairs that keep their cached KV
                cached = flow.keep_cached(li, num_layers, idx, layout, reused)
                if cached is not None:  # only reused tokens have cached KV to keep
                    cached = cached.to(dev) & reused[idx][:, None]
                    k, v = self._with_cached(li, k, v, slots[idx], cached)
            if stats is not None and reused is not None:
                r = reused[idx]
                fresh += r.sum() * k.shape[1] - (0 if cached is None else cached[r].sum())
            kv.store(li, k, v, slots[idx])  # at the selection layer: every token's fresh KV
            if li == sel_layer:
                sub = keep[idx].nonzero().squeeze(1)
                q, res, idx = q[sub], res[sub], idx[sub]
                plan = CausalRuns.of(idx)
                if stats is not None:
                    stats.recomputed_reused = int((keep & reused).sum())
            keys, values = kv.gather(li, block_table, t)  # [Hkv, T, D]
            pattern = mlp = None
            if flow is not None and reused is not None:
                s = LayerInputs(layout, li, num_layers, reused, idx, q, keys.transpose(0, 1), self.scale)
                pattern, mlp = flow.attention_pattern(s), flow.mlp_rows(s)
            if pattern is None:
                o = attend_causal(q, idx, keys, values, plan, self.scale)
            else:
                o = attend_pattern(q, idx, keys, values, pattern, self.scale)
            h = attn.o_proj(o.reshape(o.shape[0], -1))
            h, res = layer.post_attention_layernorm(h, res)
            if mlp is None:
                h = layer.mlp(h)
            else:  # rows outside `mlp` take the residual path (their MLP output is zero)
                out, sub = torch.zeros_like(h), mlp.to(dev).nonzero().squeeze(1)
                out[sub] = layer.mlp(h[sub])
                h = out
            if stats is not None:
                stats.token_layers += idx.numel()
                mlp_rows += idx.numel() if mlp is None else mlp.sum()
        if stats is not None:  # device counters, read once (no host sync per layer)
            stats.fresh_kv, stats.mlp_token_layers = int(fresh), int(mlp_rows)
        if stats is not None and sel_layer is None and reused is not None:
            stats.recomputed_reused = int((rows & reused).sum())
        h, _ = model.model.norm(h, res)
        return h

    def _with_cached(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh `[n, Hkv, D]` K/V with the (row, head) pairs of `keep` `[n, Hkv]` replaced by the pool's
        (realigned cached) values at `slots`, so the store leaves those untouched."""
        kc, vc = self.kv.read(layer, slots)
        m = keep[:, :, None]
        return torch.where(m, kc, k), torch.where(m, vc, v)

    def _select(self, flow: ReuseFlow, layout: ReuseLayout, layer: int, reused: torch.Tensor,
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows kept after the selection layer: the flow's choice among reused tokens, plus every
        non-reused token and the last one."""
        kc, vc = self.kv.read(layer, slots)  # the realigned cached KV `[T, Hkv, D]`, read before the fresh KV lands
        inputs = SelectionInputs(layout, layer, reused, q, k, v, kc, vc, self.scale)
        with stage("indexer"):
            chosen = flow.select(inputs).to(reused.device)
        keep = (chosen & reused) | ~reused
        keep[-1] = True
        return keep
