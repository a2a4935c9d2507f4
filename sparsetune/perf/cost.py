"""The bytes one decode step reads: the byte floor of the benchmarks and the modeled speed of the
search on machines where decode speed is not measured.

A decode step at batch B and context n reads every weight matrix once (of an untied embedding only
the batch's rows), on a dense layer the K/V of all n tokens, and on a sparse layer the K/V of the
blocks the flow attends (`DecodeFlow.attended_blocks`) plus, on the layers that select, every block's cached fields. Fields are stored in
the pool's dtype, as the engine keeps them. A model figure: it ignores activations, the indexer's
arithmetic and launch gaps, which is what the measured step adds to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.shapes import field_dims, index_traits
from sparsetune.models.config import ModelConfig


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int  # K and V read by attention
    fields: int  # the flow's cached fields read by its indexer

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.fields


def weight_bytes(cfg: ModelConfig, batch: int, dtype_bytes: int) -> int:
    """Weights one decode step reads: every matrix once; of an untied embedding, the batch's rows."""
    emb = cfg.vocab_size * cfg.hidden_size
    read = cfg.num_parameters() - (0 if cfg.tie_word_embeddings else emb - batch * cfg.hidden_size)
    return read * dtype_bytes


def field_bytes_per_unit(flow: DecodeFlow, cfg: ModelConfig, dtype_bytes: int) -> int:
    """A flow's cached fields of one selection unit on one layer, all KV heads (what the engine stores)."""
    dims = field_dims(flow, cfg.head_dim, flow.const_dims(cfg.head_dim))
    return cfg.num_key_value_heads * sum(r * c for r, c in dims.values()) * dtype_bytes


def forced_only(cfg: ModelConfig, flow: DecodeFlow) -> bool:
    """Whether the flow's indexer scores nothing (`F.keep_only_forced`: sinks and the local window)."""
    return index_traits(flow, cfg.head_dim, flow.const_dims(cfg.head_dim)).forced_only


def attended_tokens(cfg: ModelConfig, flow: DecodeFlow, context: int) -> int:
    """The tokens a sparse layer of `flow` attends in a sequence of `context` tokens (the budget's
    units; sinks and the local window only for an indexer that scores nothing)."""
    u = flow.unit
    units = flow.attended_blocks(-(-context // u), not forced_only(cfg, flow))
    return min(context, units * u - (-context) % u)  # the last unit (always kept) is partial


def decode_step_bytes(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, dtype_bytes: int) -> StepBytes:
    """What one decode step reads with `flow` (None: dense) at `batch` sequences of `context` tokens."""
    kv_token_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    layers = cfg.num_hidden_layers
    weights = weight_bytes(cfg, batch, dtype_bytes)
    if flow is None:
        return StepBytes(weights, batch * context * kv_token_layer * layers, 0)
    nb = -(-context // flow.unit)
    sparse = [i for i in range(layers) if i not in flow.dense_layers]
    selecting = [i for i in sparse if not flow.select_layers or i in flow.select_layers]
    attended = attended_tokens(cfg, flow, context)
    kv = batch * kv_token_layer * (context * (layers - len(sparse)) + attended * len(sparse))
    page = flow.page_flow()
    if page is None:
        fields = batch * nb * field_bytes_per_unit(flow, cfg, dtype_bytes) * len(selecting)
    else:  # two levels: every block's fields, then those of the chosen blocks' units
        npages = -(-context // page.block_size)
        chosen = page.attended_blocks(npages) * (page.block_size // flow.unit)
        per = npages * field_bytes_per_unit(page, cfg, dtype_bytes) + chosen * field_bytes_per_unit(flow, cfg, dtype_bytes)
        fields = batch * per * len(selecting)
    return StepBytes(weights, kv, fields)


def kv_share(cfg: ModelConfig, flow: DecodeFlow | None, context: int) -> float:
    """The share of the context's K/V a decode step reads with `flow` (dense layers, the attended
    blocks, sinks and local window included; fields not): the "1/8 of the context" a budget means."""
    dense = decode_step_bytes(cfg, None, 1, context, 2).kv
    return decode_step_bytes(cfg, flow, 1, context, 2).kv / dense


def modeled_speedup(cfg: ModelConfig, flow: DecodeFlow | None, batch: int, context: int, dtype_bytes: int) -> float:
    """Dense step bytes over the flow's: the decode speedup at the byte floor."""
    return decode_step_bytes(cfg, None, batch, context, dtype_bytes).total / decode_step_bytes(
        cfg, flow, batch, context, dtype_bytes).total


# ---- prefill FLOPs (a reuse flow's compute floor) -----------------------------------------------------

def prefill_flops(cfg: ModelConfig, token_layers: float, mlp_token_layers: float, attention_pairs: float) -> float:
    """Matmul FLOPs of a prefill that computes `token_layers` rows (Σ over layers), runs the MLP on
    `mlp_token_layers` of them and attends `attention_pairs` (row, key) pairs per query head (Σ over
    layers; `ReuseStats` counts all three): the attention projections, the MLP (gate, up, down) and
    QK^T + PV. Norms, RoPE and the LM head are left out (under 1% at long contexts)."""
    d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    proj = d * (hq + 2 * hkv) * hd + hq * hd * d
    mlp = 3 * d * cfg.intermediate_size
    return 2.0 * (proj * token_layers + mlp * mlp_token_layers) + 4.0 * hd * hq * attention_pairs


def full_prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """`prefill_flops` of a full causal prefill of `tokens` tokens (every row, every key before it)."""
    layers = cfg.num_hidden_layers
    return prefill_flops(cfg, layers * tokens, layers * tokens, layers * tokens * (tokens + 1) / 2)
