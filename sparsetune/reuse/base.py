"""`ReuseFlow`: the base of every KV-reuse (prefill) flow, the prefill-side counterpart of `DecodeFlow`.

A reuse flow declares hyperparameters (`Param` class attributes) and a recompute plan that the
engine executes (`reuse/executor.py`) after it has copied every reusable segment's cached KV into
the request, rotated to the segment's new position (`realign = False`: copied as stored):

- `initial_rows(layout)`: the tokens computed from layer 0 (the engine adds every token that is
  not in a reused segment, and the prompt's last token, whose logits give the first output token);
- `selection_layer(num_layers)`: None for a static plan; else layer `l`: every token is computed in
  layers `< l`; at layer `l` the engine computes q/k/v of every token, calls `select(inputs)`
  (it sees the fresh q/k/v and the cached KV, still in the pool), then writes the fresh k/v; from
  there on (attention and MLP of layer `l` included) only the non-reused tokens and the selected
  ones are computed, the rest keep their cached KV.

Recomputed rows attend over the whole prompt's KV (fresh where computed, cached elsewhere) with an
exact per-row causal mask: row at position i sees keys 0..i (not the bottom-right approximation
of CacheBlend/LMCache's short-query FlashAttention call, anchors.md §9).

Three per-layer hooks refine how the computed rows run (each sees a `LayerInputs`; None: the default):

- `attention_pattern(s)`: the keys each row may see, per head (AND-ed with the causal mask; the
  row's own key is always kept): `HeadWindows` (per KV head sinks and a window: RedKnot's local
  heads) or `Lines` (per query head vertical and slash lines: LoopServe), which run block-sparse
  in a Triton kernel on the GPU, or any function of row positions → `[Hq, n, T]` bool (a masked
  torch call);
- `keep_cached(layer, num_layers, rows, layout, reused)`: `[n, Hkv]` bool, the (row, KV head)
  pairs that keep the realigned cached KV instead of the fresh one (RedKnot's local heads);
- `mlp_rows(s)`: `[n]` bool, the rows that run the MLP; the rest take the residual path (RedKnot's
  sparse FFN).

`prepare(model)` runs once when an engine builds the flow (model-specific files, e.g. head classes);
`decode_flow` names a decode flow the engine installs with it when no `--flow` is given (LoopServe's
decode-side re-selection), with `decode_params()` as its parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from sparsetune.engine.rows import AttentionPattern, HeadWindows, Lines  # noqa: F401 - flows import the patterns here
from sparsetune.flow.params import Flow, Search
from sparsetune.kernels import line_select
from sparsetune.reuse.parts import ReuseLayout

# How `sparsetune search` samples a reuse flow's share of reused tokens recomputed (its budget):
# log-uniform, 2% to 60% (the papers' defaults are 15-16%; past 60% a reuse saves little).
RATIO_SEARCH = Search(low=0.02, high=0.6, log=True)

# Attention-mass helper: queries per chunk so a chunk's [Hq, chunk, T] probabilities stay ~256 MiB.
_MASS_CHUNK_ELEMS = 1 << 26


@dataclass
class SelectionInputs:
    """What a flow's `select` sees at its selection layer (every token's fresh q/k/v exists there)."""

    layout: ReuseLayout
    layer: int
    reused: torch.Tensor  # [T] bool
    q: torch.Tensor  # [T, Hq, D] fresh, post-RoPE
    k: torch.Tensor  # [T, Hkv, D] fresh, post-RoPE
    v: torch.Tensor  # [T, Hkv, D] fresh
    k_cached: torch.Tensor  # [T, Hkv, D] the realigned cached KV (only meaningful where `reused`)
    v_cached: torch.Tensor
    scale: float

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    def attention_mass(self, query_rows: torch.Tensor) -> torch.Tensor:
        """`[T]` float32: Σ over query heads and the given query positions of the causal softmax
        attention probability each key receives (the Sparse-Q / A³ question-attention score)."""
        return attention_mass(self.q[query_rows], self.k, query_rows, self.scale)

    def top(self, score: torch.Tensor, count: int, among: torch.Tensor | None = None) -> torch.Tensor:
        """`[T]` bool: the `count` highest-scoring tokens of `among` (default: the reused ones)."""
        among = self.reused if among is None else among
        score = score.float().masked_fill(~among, float("-inf"))
        count = max(0, min(count, int(among.sum())))
        keep = torch.zeros_like(among)
        if count:
            keep[score.topk(count).indices] = True
        return keep


@dataclass
class LayerInputs:
    """What a flow's per-layer hooks see: the rows computed at this layer and the prompt's keys."""

    layout: ReuseLayout
    layer: int
    num_layers: int
    reused: torch.Tensor  # [T] bool
    rows: torch.Tensor  # [n] positions computed at this layer (sorted; always ends with the last token)
    q: torch.Tensor  # [n, Hq, D] their fresh queries, post-RoPE
    keys: torch.Tensor | Callable[[], torch.Tensor]  # `k`, or what reads it from the pool (on first use)
    scale: float

    @functools.cached_property
    def k(self) -> torch.Tensor:
        """`[T, Hkv, D]` the prompt's keys as attention will read them (after this layer's store)."""
        return self.keys() if callable(self.keys) else self.keys

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


def attention_probs(q: torch.Tensor, k: torch.Tensor, query_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention `[Hq, n, T]` float32 of queries `q` `[n, Hq, D]` at positions `query_rows`
    over all T keys `k` `[T, Hkv, D]` (a query head reads its GQA group's KV head)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3).reshape(hkv, -1, d)  # [Hkv, G * n, D]
    # One batched GEMM per KV head over the [D, T] view of its keys (a broadcast matmul copied the
    # keys once per query head of the group: 1 ms a layer at 32K on an H100, #18)
    logits = torch.bmm(qg, k.float().permute(1, 2, 0)).view(hq, n, -1).mul_(scale)  # [Hq, n, T]
    pos = torch.arange(k.shape[0], device=q.device)
    logits.masked_fill_(pos[None, None, :] > query_rows[None, :, None], float("-inf"))
    return F.softmax(logits, dim=-1)


def slash_masses(probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per head, the mass of every slash line (distance d: the entries rows[r] - j = d) of a causal
    map `probs` `[H, n, T]` → `[H, T]` (`kernels/line_select`, a Triton kernel on CUDA)."""
    fn = line_select.slash_masses if probs.is_cuda else line_select.slash_masses_ref
    return fn(probs, rows)


def cover_histogram(probs: torch.Tensor, rows: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """A causal map's mass by 1 + the better rank of each entry's two lines (`rank` `[H, 2T]`: key
    j's vertical at j, distance d's slash at T + d) → `[H, 2T + 1]` float64; its cumulative sum is
    what the union of the top k lines covers, for every k (`kernels/line_select`)."""
    fn = line_select.cover_histogram if probs.is_cuda else line_select.cover_histogram_ref
    return fn(probs, rows, rank)


def attention_mass(q: torch.Tensor, k: torch.Tensor, query_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of queries `q` `[n, Hq, D]` at positions `query_rows` over all T keys,
    summed over query heads and queries: `[T]` float32. Chunked over queries to bound memory."""
    t, hq = k.shape[0], q.shape[1]
    mass = torch.zeros(t, dtype=torch.float32, device=q.device)
    k = k.float()  # once, not per chunk
    chunk = max(1, _MASS_CHUNK_ELEMS // (hq * t))
    for s in range(0, query_rows.numel(), chunk):
        mass += attention_probs(q[s : s + chunk], k, query_rows[s : s + chunk], scale).sum(dim=(0, 1))
    return mass


class ReuseFlow(Flow):
    realign: ClassVar[bool] = True  # False: cached keys keep their old positions (naive reuse)
    reads_cache: ClassVar[bool] = True  # False: the flow never uses cached KV (full recompute)
    decode_flow: ClassVar[str | None] = None  # a decode flow installed with this one when no --flow is given

    def prepare(self, model: str, random_weights: bool, config) -> None:
        """Called once by the engine that runs the flow (`config`: its `ModelConfig`)."""

    def decode_params(self) -> dict[str, str]:
        """Raw parameters of `decode_flow`, from this flow's own."""
        return {}

    def initial_rows(self, layout: ReuseLayout) -> torch.Tensor:
        """`[T]` bool: the tokens computed from layer 0 (default: none besides the engine's own)."""
        return torch.zeros(layout.num_tokens, dtype=torch.bool)

    def selection_layer(self, num_layers: int) -> int | None:
        return None

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        """`[T]` bool: the reused tokens to recompute from the selection layer on."""
        raise NotImplementedError(f"{type(self).__name__} has a selection layer but no `select`")

    def attention_pattern(self, s: LayerInputs) -> AttentionPattern | None:
        return None

    def keep_cached(self, layer: int, num_layers: int, rows: torch.Tensor, layout: ReuseLayout,
                    reused: torch.Tensor) -> torch.Tensor | None:
        return None

    def mlp_rows(self, s: LayerInputs) -> torch.Tensor | None:
        return None

    def head_paged_kv_fraction(self, layout: ReuseLayout) -> float | None:
        """Share of the prompt's per-head KV that a head-paged store (RedKnot's SegPagedAttention)
        would keep for this flow; None: the flow keeps every head's KV."""
        return None

    def recompute_count(self, num_reused: int) -> int:
        """The selection budget of a ratio-based flow: `ratio` of the reused tokens."""
        return round(getattr(self, "ratio") * num_reused)
