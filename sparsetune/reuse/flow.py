"""`ReuseFlow`: the base of every KV-reuse (prefill) flow, the prefill-side counterpart of `DecodeFlow`.

A reuse flow declares hyperparameters (`Param` class attributes) and a recompute plan that the
engine executes (`reuse/executor.py`) after it has copied every reusable segment's cached KV into
the request, rotated to the segment's new position (`realign = False`: copied as stored):

- `initial_rows(layout)`: the tokens computed from layer 0 (the engine adds every token that is
  not in a reused segment, and the prompt's last token, whose logits give the first output token);
- `selection_layer(num_layers)`: None for a static plan; else layer `l`: every token is computed in
  layers `< l`; at layer `l` the engine computes q/k/v of every token, writes the fresh k/v, and
  calls `select(inputs)`; from there on (attention and MLP of layer `l` included) only the
  non-reused tokens and the selected ones are computed, the rest keep their cached KV.

Recomputed rows attend over the whole prompt's KV (fresh where computed, cached elsewhere) with an
exact per-row causal mask: row at position i sees keys 0..i (not the bottom-right approximation
of CacheBlend/LMCache's short-query FlashAttention call, anchors.md §9).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparsetune.flow.params import Configurable
from sparsetune.reuse.parts import ReuseLayout

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
        return attention_mass(self.q, self.k, query_rows, self.scale)

    def top(self, score: torch.Tensor, count: int, among: torch.Tensor | None = None) -> torch.Tensor:
        """`[T]` bool: the `count` highest-scoring tokens of `among` (default: the reused ones)."""
        among = self.reused if among is None else among
        score = score.float().masked_fill(~among, float("-inf"))
        count = max(0, min(count, int(among.sum())))
        keep = torch.zeros_like(among)
        if count:
            keep[score.topk(count).indices] = True
        return keep


def attention_mass(q: torch.Tensor, k: torch.Tensor, query_rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of the queries at positions `query_rows` over all T keys, summed over
    query heads and queries: `[T]` float32. Chunked over queries to bound memory at long contexts."""
    t, hq = k.shape[0], q.shape[1]
    group = hq // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
    mass = torch.zeros(t, dtype=torch.float32, device=q.device)
    chunk = max(1, _MASS_CHUNK_ELEMS // (hq * t))
    pos = torch.arange(t, device=q.device)
    for s in range(0, query_rows.numel(), chunk):
        rows = query_rows[s : s + chunk]
        logits = torch.matmul(q[rows].float().transpose(0, 1), keys.transpose(1, 2)) * scale  # [Hq, n, T]
        logits.masked_fill_(pos[None, None, :] > rows[None, :, None], float("-inf"))
        mass += F.softmax(logits, dim=-1).sum(dim=(0, 1))
    return mass


class ReuseFlow(Configurable):
    realign: ClassVar[bool] = True  # False: cached keys keep their old positions (naive reuse)
    reads_cache: ClassVar[bool] = True  # False: the flow never uses cached KV (full recompute)

    def initial_rows(self, layout: ReuseLayout) -> torch.Tensor:
        """`[T]` bool: the tokens computed from layer 0 (default: none besides the engine's own)."""
        return torch.zeros(layout.num_tokens, dtype=torch.bool)

    def selection_layer(self, num_layers: int) -> int | None:
        return None

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        """`[T]` bool: the reused tokens to recompute from the selection layer on."""
        raise NotImplementedError(f"{type(self).__name__} has a selection layer but no `select`")

    def recompute_count(self, num_reused: int) -> int:
        """The selection budget of a ratio-based flow: `ratio` of the reused tokens."""
        return round(getattr(self, "ratio") * num_reused)
