"""Offline head profiling for RedKnot (`sparsetune flows profile-heads`): which KV heads are global.

After RedKnot's `head_profiler.py` (anchors.md §4): each calibration chunk runs alone and again
behind each of two neutral prefixes. Per layer and query head:

- prefix shift = 1 − cos(the chunk's attention map alone, the same map behind the prefix), the
  maps flattened over the chunk's queries and keys (the prefix's rows and columns dropped);
- edge mass = the share of the chunk queries' attention (behind the prefix) that falls outside
  the sinks [0, sink) and the local window (i − window, i].

A head's score is max(prefix shift, edge mass), averaged over chunks and prefixes and reduced to
KV heads by the max over the query group. The file is JSON:

    {"model", "method", "num_layers", "num_kv_heads", "sink", "window", "chunks", "chunk_tokens",
     "prefix_shift", "edge_mass", "scores": [layer][kv_head] → float}

The `redknot` flow makes the top `global_ratio` of all (layer, KV head) scores global heads
(RedKnot's default 15%) and the rest local, so the ratio stays a searchable parameter. The
file's format and how a flow reads it are in `sparsetune.models.artifacts`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.calibration.channels import builtin_text
from sparsetune.models.artifacts import HEAD_CLASSES, artifact_path
from sparsetune.models.registry import DEFAULT_MODEL
from sparsetune.reuse.base import attention_probs

METHOD = "RedKnot: max(1 - cos(map alone, map behind a prefix), mass outside sinks + window), max over the query group"
PREFIXES = ("The following document is provided for reference.", "Background context unrelated to the question below.")


class _MapRecorder(DenseAttention):
    """Dense attention that compares each layer's attention map of a chunk alone with the same
    chunk behind a prefix, and measures the chunk's attention mass outside sinks + window."""

    attends_last_rows = False  # it records every row of every layer

    def __init__(self, scale: float, num_layers: int, num_heads: int, sink: int, window: int) -> None:
        super().__init__(scale)
        self.sink, self.window = sink, window
        self.prefix_len: int | None = None  # None: the chunk runs alone
        self.alone: dict[int, torch.Tensor] = {}
        self.shift = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self.edge = torch.zeros(num_layers, num_heads, dtype=torch.float64)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        p = self.prefix_len or 0
        pos = torch.arange(p, q.shape[0], device=q.device)
        probs = attention_probs(q[p:], k, pos, self.scale)  # [Hq, n, p + n]
        if self.prefix_len is None:
            self.alone[layer] = probs.half()
        else:
            keys = torch.arange(q.shape[0], device=q.device)
            inside = (keys[None, :] < self.sink) | (pos[:, None] - keys[None, :] < self.window)  # [n, T]
            self.edge[layer] += (probs * ~inside).sum(-1).mean(-1).double().cpu()
            ref = self.alone[layer].float().flatten(1)
            self.shift[layer] += (1 - F.cosine_similarity(probs[:, :, p:].flatten(1), ref, dim=1)).double().cpu()
        return super().prefill(layer, q, k, v, kv, meta)


def profile_heads(
    model: str = DEFAULT_MODEL,
    text: str | None = None,
    chunks: int = 4,
    chunk_tokens: int = 512,
    sink: int = 4,
    window: int = 512,
    random_weights: bool = False,
    device: str | None = None,
    out: str | Path | None = None,
) -> Path:
    """Profile `model`'s heads on `chunks` chunks of `chunk_tokens` tokens of `text` (default: the
    built-in text) and write the scores to `out` (default: the model's file, which `redknot` reads)."""
    from sparsetune.llm import LLM
    from sparsetune.engine.sequence import SamplingParams

    if chunks < 1 or chunk_tokens < 2:
        raise SparsetuneError(f"--chunks must be >= 1 and --chunk-tokens >= 2 (got {chunks}, {chunk_tokens})")
    if sink < 0 or window < 1:
        raise SparsetuneError(f"--sink must be >= 0 and --window >= 1 (got {sink}, {window})")
    llm = LLM(model=model, device=device, random_weights=random_weights, cuda_graph=False)
    if llm.tokenizer is None:
        raise SparsetuneError(f"{llm.resolved.name} has no tokenizer files; head profiling needs one to encode its text")
    ids = llm.tokenizer.encode(builtin_text() if text is None else text)
    prefixes = [llm.tokenizer.encode(p) for p in PREFIXES]
    # One prefill call per run (the recorder reads each sequence whole): no chunked prefill.
    room = min(llm.engine.max_model_len - 1, llm.config.max_num_batched_tokens)
    chunk_tokens = min(chunk_tokens, room - max(map(len, prefixes)))
    pieces = [ids[i : i + chunk_tokens] for i in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)][:chunks]
    if not pieces:
        raise SparsetuneError(f"the text has {len(ids)} tokens, fewer than one chunk of {chunk_tokens}; "
                              "pass a longer --text or a smaller --chunk-tokens")
    cfg = llm.model_config
    rec = _MapRecorder(cfg.head_dim**-0.5, cfg.num_hidden_layers, cfg.num_attention_heads, sink, window)
    llm.set_attention(rec)
    one = SamplingParams(max_tokens=1)
    for piece in pieces:
        rec.prefix_len = None
        llm.generate([piece], one, chat=False)
        for pre in prefixes:
            rec.prefix_len = len(pre)
            llm.generate([pre + piece], one, chat=False)
    runs = len(pieces) * len(prefixes)
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:  # [L, Hq] → [L, Hkv], max over the query group
        return (x / runs).view(cfg.num_hidden_layers, cfg.num_key_value_heads, group).amax(-1)

    shift, edge = per_kv_head(rec.shift), per_kv_head(rec.edge)
    path = Path(out).expanduser() if out is not None else artifact_path(llm.resolved.name, random_weights, HEAD_CLASSES)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model": llm.resolved.name, "method": METHOD, "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": cfg.num_key_value_heads, "sink": sink, "window": window, "chunks": len(pieces),
        "chunk_tokens": chunk_tokens, "prefix_shift": shift.tolist(), "edge_mass": edge.tolist(),
        "scores": torch.maximum(shift, edge).tolist(),
    }))
    return path
