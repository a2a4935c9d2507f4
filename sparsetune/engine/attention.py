"""The attention interface of the engine's batch steps.

Every prefill and decode attention call of a scheduled batch goes through an
`AttentionBackend` chosen per layer. It receives the layer index, q (and the
new k/v), the paged KV pool, block tables and sequence lengths in an
`AttentionMetadata`. `DenseAttention` is the first implementation; sparse
decode flows subclass it and override one stage. A forward over a subset of
one sequence's rows (a reuse prefill) attends through `engine/rows.py` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.ranges import stage
from sparsetune.kernels import paged_decode


@dataclass
class AttentionMetadata:
    """Describes one forward step's batch for attention.

    Tokens of all sequences are packed along one dimension (N tokens). In a
    decode step every sequence contributes exactly one token (N == B).
    """

    is_prefill: bool
    positions: torch.Tensor  # [N] int64, RoPE position of each new token
    slot_mapping: torch.Tensor  # [N] int64, flat KV slot each new token is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    # Host-side copies, for prefill's per-sequence loop and for flows' bookkeeping.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]  # [B + 1] offsets of each sequence's new tokens
    seq_ids: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def last_rows(self, device: torch.device) -> torch.Tensor:
        """`[B]` index of each sequence's last new token among the packed rows."""
        return torch.tensor(self.query_start_loc_cpu[1:], device=device) - 1

    def context_len(self, i: int) -> int:
        """Tokens of sequence i already in the cache before this step."""
        return self.seq_lens_cpu[i] - (self.query_start_loc_cpu[i + 1] - self.query_start_loc_cpu[i])


class AttentionBackend:
    """Base of every attention implementation; see the module docstring."""

    name = "base"
    # Whether a prefill's last layer may attend with each sequence's last token only (`forward`'s
    # `last`), when nothing reads the other rows' outputs; a backend that records every row says no.
    attends_last_rows = False

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q `[N, Hq, D]`, k/v `[N, Hkv, D]` for the new tokens → `[N, Hq, D]`. With `last`
        (`meta.last_rows`, a prefill): every row's K/V is stored, and only those rows attend → `[B, Hq, D]`."""
        self.write_kv(layer, k, v, kv, meta)
        with stage("attention"):  # a flow's indexer and top-k inside it are ranges of their own
            if last is not None:
                return self.attend_last(layer, q[last], kv, meta)
            if meta.is_prefill:
                return self.prefill(layer, q, k, v, kv, meta)
            return self.decode(layer, q, kv, meta)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> None:
        with stage("kv_store"):
            kv.store(layer, k, v, meta.slot_mapping)

    def prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def attend_last(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Each sequence's last token `[B, Hq, D]` over all its keys in the pool, as the prefill would."""
        raise NotImplementedError

    def rebuild_fields(self, layer: int, kv: KVCache, block_table: torch.Tensor, num_tokens: int) -> None:
        """What the backend keeps per KV block (a decode flow's fields), over a sequence's first
        `num_tokens` tokens whose KV was written without it (a planned prefill, an admitted one)."""


# cuDNN attention prefills ~1.7x faster than the flash backend on H200 at 32K tokens
# (587 vs 345 TFLOP/s, benchmarks/bench_prefill_attention.py); torch falls through the
# list when a backend cannot take the inputs (cuDNN has no fp32, for instance).
_PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_backends():
    try:
        return sdpa_kernel(_PREFILL_BACKENDS, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order: the default one applies
        return sdpa_kernel(_PREFILL_BACKENDS)


_cudnn_chunks = True  # False once cuDNN refuses a chunk (an older GPU or torch): the masked call then


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Causal attention of `[H, n, D]` queries over `[Hkv, context_len + n, D]` keys."""
    global _cudnn_chunks
    n, total = q.shape[1], k.shape[1]
    if context_len and _cudnn_chunks and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # A chunk behind cached keys: torch sends bottom-right causal masks to its flash kernel only
        # (~345 TFLOP/s on an H100 at 32K, against cuDNN's ~600), so cuDNN runs the two halves.
        try:
            return _cudnn_chunk(q, k, v, context_len, scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # no cuDNN attention for these inputs here
            _cudnn_chunks = False
    if context_len == 0:
        mask, causal = None, True
    else:
        # The queries are the last n positions: bottom-right causal alignment is exact here.
        mask, causal = causal_lower_right(n, total), False
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out.squeeze(0)


def _cudnn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """`causal_sdpa` with cached keys through cuDNN: the queries over the cached keys (no mask) and over
    their own keys (causal), merged by their log-sum-exps."""
    c = context_len
    o1, l1 = _cudnn_lse(q, k[:, :c], v[:, :c], False, scale)
    o2, l2 = _cudnn_lse(q, k[:, c:], v[:, c:], True, scale)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_(), (l2 - m).exp_()
    total = w1 + w2
    return torch.addcmul(o1 * (w1 / total).unsqueeze(-1), o2, (w2 / total).unsqueeze(-1)).to(q.dtype)


def _cudnn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN attention `[H, n, D]` → (output `[H, n, D]` float32, log-sum-exp `[H, n]` float32)."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, True, 0.0, causal, False, scale=scale)
    return out[0].squeeze(0).float(), out[1].squeeze(0).view(q.shape[0], q.shape[1]).float()


class DenseAttention(AttentionBackend):
    """Full attention. Prefill: torch SDPA per sequence; decode: the paged kernel.

    `use_triton`: None picks the Triton decode kernel on CUDA and the torch reference on CPU;
    False forces the torch reference (on GPU too), True the Triton kernel (interpreted on CPU).
    """

    name = "dense"
    attends_last_rows = True

    def __init__(self, scale: float, use_triton: bool | None = None) -> None:
        self.scale = scale
        self.use_triton = use_triton

    def prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        with prefill_backends():
            for i in range(meta.batch_size):
                s, e = qsl[i], qsl[i + 1]
                ctx = meta.context_len(i)
                if ctx == 0:
                    # Nothing cached before: attend over the new tokens directly, no gather.
                    ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                else:
                    ki, vi = kv.gather(layer, meta.block_tables[i], meta.seq_lens_cpu[i])
                out[s:e] = causal_sdpa(q[s:e].transpose(0, 1), ki, vi, ctx, self.scale).transpose(0, 1)
        return out

    def triton_path(self, q: torch.Tensor) -> bool:
        return q.is_cuda if self.use_triton is None else self.use_triton

    def decode(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        fn = paged_decode.paged_decode_attention if self.triton_path(q) else paged_decode.paged_decode_attention_ref
        return fn(q, kv.k[layer], kv.v[layer], meta.block_tables, meta.seq_lens, self.scale)

    def attend_last(self, layer: int, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # A last token sees every key of its sequence: dense decode's arithmetic, whatever a flow's decode does.
        return DenseAttention.decode(self, layer, q, kv, meta)


@dataclass
class ForwardContext:
    """Everything a forward step needs besides the token ids; passed down explicitly."""

    meta: AttentionMetadata
    kv: KVCache
    backends: list[AttentionBackend]  # one per layer
