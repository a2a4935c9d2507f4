"""Channel calibration for calibrated flows (DoubleSparse): which channels of each layer's KV
heads carry q·k.

`calibrate` runs the engine's own dense prefill over calibration text with a recording
attention backend and ranks, per layer and KV head, the channels by mean|q⊙k| over tokens
(same position; post-RoPE, since the model rotates q and k before it calls the backend;
summed over the KV head's query group, which shares one selection). The file's format, and
how a flow reads it back (`resolve_calibration`), are in `sparsetune.models.artifacts`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.models.artifacts import CALIBRATION, artifact_path, write_calibration
from sparsetune.models.registry import DEFAULT_MODEL

STATISTIC = "mean|q*k| post-RoPE, summed over the KV head's query group"
DEFAULT_TOKENS = 2048


def builtin_text() -> str:
    """The English text shipped for calibration (a few thousand tokens of varied prose)."""
    return (resources.files("sparsetune") / "data" / "calibration.txt").read_text(encoding="utf-8")


class _Recorder(DenseAttention):
    """Dense attention that also sums |q ⊙ k| per layer, KV head and channel over prefill tokens."""

    attends_last_rows = False  # it records every row of every layer

    def __init__(self, scale: float, num_layers: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        super().__init__(scale)
        self.sums = torch.zeros(num_layers, num_kv_heads, head_dim, dtype=torch.float64, device=device)

    def prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, hkv, d = k.shape
        qk = q.view(n, hkv, -1, d).double() * k.double()[:, :, None, :]  # [n, Hkv, G, D], same position
        self.sums[layer] += qk.abs().sum((0, 2))
        return super().prefill(layer, q, k, v, kv, meta)


def calibrate(
    model: str = DEFAULT_MODEL,
    text: str | None = None,
    tokens: int = DEFAULT_TOKENS,
    random_weights: bool = False,
    device: str | None = None,
    out: str | Path | None = None,
) -> Path:
    """Calibrate `model` on `text` (default: the built-in text), at most `tokens` tokens, and
    write the file to `out` (default: the model's file, `models.artifacts.artifact_path`). Returns the path written."""
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams

    if tokens < 1:
        raise SparsetuneError(f"--tokens must be at least 1 (got {tokens})")
    llm = LLM(model=model, device=device, random_weights=random_weights, cuda_graph=False)
    if llm.tokenizer is None:
        raise SparsetuneError(f"{llm.resolved.name} has no tokenizer files; calibration needs one to encode its text")
    ids = llm.tokenizer.encode(builtin_text() if text is None else text)[:tokens]
    if not ids:
        raise SparsetuneError("the calibration text is empty")
    cfg = llm.model_config
    recorder = _Recorder(cfg.head_dim**-0.5, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, llm.device)
    llm.set_attention(recorder)
    span = llm.engine.max_model_len - 1  # longer texts run as several sequences; each leaves room for one new token
    llm.generate([ids[i : i + span] for i in range(0, len(ids), span)], SamplingParams(max_tokens=1), chat=False)
    scores = (recorder.sums / len(ids)).cpu()  # [L, Hkv, D]
    order = scores.argsort(dim=-1, descending=True, stable=True)
    path = Path(out).expanduser() if out is not None else artifact_path(llm.resolved.name, random_weights, CALIBRATION)
    return write_calibration(path, llm.resolved.name, order.tolist(), scores.tolist(), len(ids), STATISTIC)
