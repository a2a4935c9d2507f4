"""RedKnot (arXiv 2606.06256, Alg. 1; rednote-machine-learning/RedKnot): head-class recovery.

Every token runs every layer, but what it recovers depends on the head. An offline profile
(`sparsetune flows profile-heads`) scores each (layer, KV head); the top `global_ratio` are
global heads, the rest local. In the first `dense_layers` layers every head is global.

- Global heads recompute the KV of every token and attend over the whole prompt (causal).
- Local heads attend only to the sinks [0, sink) and the window (i − window, i]. They keep the
  realigned cached KV of a reused token, except the sinks and the first `window` tokens of each
  segment, whose window now reaches into new context; those are repaired (fresh KV).
- Sparse FFN: from layer `ffn_layer` on, a reused token runs the MLP only if it is among the
  tokens holding `ffn_mass` of the attention that the last `ffn_recent` rows give. Every other
  reused token takes the residual path. New tokens and the last `ffn_recent` always run the MLP.

`head_paged_kv_fraction` reports the share of KV that RedKnot's SegPagedAttention would keep:
global heads keep every token, local heads only the sinks and the last `window` tokens. The
engine's pool stays token-paged, so that memory is computed here, not freed.

Differences from RedKnot's code: the dense prefix layers recompute instead of attending the
offline KV. The sparse-FFN importance is the recent rows' attention mass, one threshold.
"""

import torch

from sparsetune.flow import Param, Search
from sparsetune.reuse import ReuseFlow, HeadWindows, attention_mass
from sparsetune.models.artifacts import resolve_head_scores
from sparsetune.reuse.head_classes import global_heads

FFN_SHARE = 0.75  # the default first sparse-FFN layer, as a share of the layers

class RedKnot(ReuseFlow):
    name = "redknot"
    source = "RedKnot, arXiv 2606.06256"
    head_classes = Param("auto", doc="head profile file; auto: the model's (`sparsetune flows profile-heads --model M`)")
    rank_by = Param("scores", choices=("scores", "edge_mass", "prefix_shift"),
                    doc="profile field that ranks the heads (scores: RedKnot's max of the two)")
    global_ratio = Param(0.15, low=0.0, high=1.0, doc="share of (layer, KV head) pairs that are global (RedKnot: 12-15%)",
                         search=Search(low=0.02, high=0.5, log=True))
    window = Param(512, low=1, high=1 << 20, log=True, doc="local heads' window w (RedKnot default 512)",
                   search=Search(choices=(64, 128, 256, 512, 1024)))
    sink = Param(4, low=0, high=1024, doc="sink tokens every local head keeps", search=Search(choices=(0, 4, 16)))
    dense_layers = Param(2, low=0, high=1024, doc="first layers where every head is global", search=Search(low=0, high=6))
    ffn_layer = Param(None, low=0, high=1024, kind=int, doc="first sparse-FFN layer; default 75% of the layers (RedKnot: 48 of 64)",
                      search=Search(layers="index", share=FFN_SHARE))
    ffn_mass = Param(0.6, low=0.0, high=1.0, doc="attention mass the MLP tokens must hold (RedKnot mass_thresh)",
                     search=Search(low=0.3, high=0.95))
    ffn_recent = Param(128, low=1, high=1 << 20, log=True, doc="last rows whose attention ranks the tokens; they always run the MLP",
                       search=Search(choices=(32, 64, 128, 256)))

    _global: torch.Tensor | None = None  # [layers, kv_heads] bool, set by prepare

    def prepare(self, model, random_weights, config):
        scores = resolve_head_scores(self.head_classes, model, random_weights, config.num_hidden_layers,
                                     config.num_key_value_heads, self.rank_by)
        self.set_head_scores(scores)

    def set_head_scores(self, scores: torch.Tensor) -> None:
        """Global heads from profile scores `[layers, kv_heads]` (prepare reads them from the file)."""
        self._global = global_heads(scores, self.global_ratio)
        self._global[: self.dense_layers] = True

    def _heads(self, layer: int) -> torch.Tensor:
        if self._global is None:
            raise RuntimeError("redknot has no head classes; the engine calls prepare() with the model's profile")
        return self._global[layer]

    def _repair(self, layout, device) -> torch.Tensor:
        """`[T]` bool: tokens whose local-head KV is recomputed (sinks, non-reused, each segment's first window)."""
        pos = torch.arange(layout.num_tokens, device=device)
        start = torch.zeros_like(pos)
        reused = layout.reused_mask(device)
        for span in layout.segments:
            start[span.start : span.end] = span.start
        return (pos < self.sink) | ~reused | (pos - start < self.window)

    def initial_rows(self, layout):
        return torch.ones(layout.num_tokens, dtype=torch.bool)  # every token runs every layer

    def keep_cached(self, layer, num_layers, rows, layout, reused):
        local = ~self._heads(layer).to(rows.device)
        if not bool(local.any()):
            return None
        return ~self._repair(layout, rows.device)[rows][:, None] & local[None, :]

    def attention_pattern(self, s):
        local = ~self._heads(s.layer).to(s.q.device)
        if not bool(local.any()):
            return None
        sinks = torch.where(local, self.sink, 0)  # global heads: no sinks, no window
        windows = torch.where(local, self.window, HeadWindows.UNBOUNDED)
        return HeadWindows(sinks, windows, s.q.shape[1] // local.numel(), s.num_tokens)

    def mlp_rows(self, s):
        start = round(FFN_SHARE * s.num_layers) if self.ffn_layer is None else self.ffn_layer
        if s.layer < start:
            return None
        recent = s.rows[-self.ffn_recent :]
        q = s.q[-self.ffn_recent :]
        mass = attention_mass(q, s.k, recent, s.scale)  # [T]
        order = mass.argsort(descending=True)
        need = torch.searchsorted(mass[order].cumsum(0), self.ffn_mass * mass.sum()).clamp(max=mass.numel() - 1)
        important = torch.zeros_like(s.reused)
        important[order[: int(need) + 1]] = True
        important[recent] = True
        return (important | ~s.reused)[s.rows]

    def head_paged_kv_fraction(self, layout):
        if self._global is None:
            return None
        t = layout.num_tokens
        local_keep = min(t, self.sink + self.window)
        heads = self._global.numel()
        glob = int(self._global.sum())
        return (glob * t + (heads - glob) * local_keep) / (heads * t)

