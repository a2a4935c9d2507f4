"""Decoder-only transformer of the Llama family: Llama (SmolLM2, Llama 3.x), Qwen2, Qwen3.

Tokens of the whole batch are packed into one dimension (`[N, hidden]`), as in
nano-vllm: no padding, and one code path for prefill and decode. Attention
itself is delegated to the per-layer `AttentionBackend` in the `ForwardContext`.
Given a `Rows` instead (`engine/rows.py`), the same layers run over a subset of
one sequence's rows that the caller chooses per layer (the reuse executor's plan).
Weights use HF names, except that q/k/v and gate/up are fused into one matrix
each (`qkv_proj`, `gate_up_proj`) so a decode step reads them in one GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsetune.engine.attention import ForwardContext
from sparsetune.engine.rows import Rows
from sparsetune.engine.ranges import stage
from sparsetune.engine.rope import cos_sin_table
from sparsetune.kernels import fused_ops
from sparsetune.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    fn = fused_ops.rms_norm if x.is_cuda else fused_ops.rms_norm_ref
    with stage("norm"):
        return fn(x, weight, eps, residual)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, hidden: torch.Tensor, cos_sin: torch.Tensor, ctx: ForwardContext, last: torch.Tensor | None = None
    ) -> torch.Tensor:
        q, k, v = self.qkv(hidden, ctx.meta.positions, cos_sin)
        o = ctx.backends[self.layer_idx].forward(self.layer_idx, q, k, v, ctx.kv, ctx.meta, last)
        return self.o_proj(o.reshape(o.shape[0], self.q_size))

    def qkv(self, hidden: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[N, hidden]` at RoPE positions `pos` → q `[N, Hq, D]`, k and v `[N, Hkv, D]` (q and k post-RoPE)."""
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views into the fused projection; the rope kernels work in place on them.
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        with stage("rope"):  # Qwen3's qk-norm is fused into it
            if self.q_norm is not None:
                fn = fused_ops.qk_norm_rope if q.is_cuda else fused_ops.qk_norm_rope_ref
                q, k = fn(q, k, pos, cos_sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                fn = fused_ops.apply_rope if q.is_cuda else fused_ops.apply_rope_ref
                q, k = fn(q, k, pos, cos_sin)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = fused_ops.silu_and_mul if x.is_cuda else fused_ops.silu_and_mul_ref
        with stage("activation"):
            h = act(gate_up)
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor, ctx: ForwardContext | None,
        rows: Rows | None = None, last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual block; the residual add is fused into the next norm. With `rows`, its rows
        store their K/V, narrow to the ones that go on, attend, and run the MLP where it says. With
        `last` (row indices), every row stores its K/V and only those rows go on past attention."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if rows is None:
            hidden = self.self_attn(hidden, cos_sin, ctx, last)
            if last is not None:
                residual = residual[last]
        else:
            attn = self.self_attn
            q, k, v = attn.qkv(hidden, rows.positions, cos_sin)
            q, residual = rows.write_kv(self.idx, q, k, v, residual)
            hidden = attn.o_proj(rows.attention(self.idx, q).reshape(q.shape[0], attn.q_size))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden) if rows is None else rows.mlp(self.idx, self.mlp, hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        table = cos_sin_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext | None = None, rows: Rows | None = None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed token ids `[N]` → final hidden states `[N, hidden]`, attention through `ctx`'s backends.
        With `last` (row indices; a prefill whose backends all attend last rows): the last layer runs
        attention's output and the MLP on those rows only (every row's K/V is still stored) → `[len(last), hidden]`.
        With `rows` (no `ctx`): the ids of `rows.positions` → the hidden states of the rows left after the last layer."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        final = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, self.cos_sin, ctx, rows, last if i == final else None)
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
