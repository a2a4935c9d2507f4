"""Channel calibration for calibrated flows (DoubleSparse): which channels of each layer's KV
heads carry q·k.

`calibrate` runs the engine's own dense prefill over calibration text with a recording
attention backend and ranks, per layer and KV head, the channels by mean|q⊙k| over tokens
(same position; post-RoPE, since the model rotates q and k before it calls the backend;
summed over the KV head's query group, which shares one selection). The file is JSON:

    {"model", "statistic", "num_layers", "num_kv_heads", "head_dim", "tokens",
     "channels": [layer][kv_head] → channel indices, most important first,
     "scores":   [layer][kv_head][channel] → the statistic of that channel}

`load_calibration` reads it back, checked against the model's shapes; `resolve_calibration`
is what the engine calls for a calibrated flow (`calibration="auto"`: the model's default file).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import torch

from sparsetune.engine.attention import AttentionMetadata, DenseAttention
from sparsetune.engine.kv_cache import KVCache
from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.models.registry import DEFAULT_MODEL, models_dir

STATISTIC = "mean|q*k| post-RoPE, summed over the KV head's query group"
DEFAULT_TOKENS = 2048

Calibration = list[list[list[int]]]  # [layer][kv_head] → channel indices, most important first


def default_path(model: str, random_weights: bool = False, kind: str = "calibration") -> Path:
    """`<cache>/<kind>/<model>.json` (kind: "calibration", or "head_classes" for RedKnot's head
    profile), next to the models cache (`SPARSETUNE_MODELS` moves both). A local model directory's
    path becomes one file name; a random-weight profile gets its own file, so it never stands in
    for the real weights'."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip("/\\"))
    return models_dir().parent / kind / f"{stem}{'-random-weights' if random_weights else ''}.json"


def builtin_text() -> str:
    """The English text shipped for calibration (a few thousand tokens of varied prose)."""
    return (resources.files("sparsetune") / "data" / "calibration.txt").read_text(encoding="utf-8")


class _Recorder(DenseAttention):
    """Dense attention that also sums |q ⊙ k| per layer, KV head and channel over prefill tokens."""

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
    write the file to `out` (default: `default_path`). Returns the path written."""
    from sparsetune.engine.llm import LLM
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
    span = llm.max_model_len - 1  # longer texts run as several sequences; each leaves room for one new token
    llm.generate([ids[i : i + span] for i in range(0, len(ids), span)], SamplingParams(max_tokens=1), chat=False)
    scores = (recorder.sums / len(ids)).cpu()  # [L, Hkv, D]
    order = scores.argsort(dim=-1, descending=True, stable=True)
    path = Path(out).expanduser() if out is not None else default_path(llm.resolved.name, random_weights)
    return write_calibration(path, llm.resolved.name, order.tolist(), scores.tolist(), len(ids), STATISTIC)


def write_calibration(
    path: Path, model: str, channels: Calibration, scores: list | None, tokens: int, statistic: str
) -> Path:
    """Write a calibration file (the format `load_calibration` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "model": model, "statistic": statistic, "num_layers": len(channels), "num_kv_heads": len(channels[0]),
        "head_dim": len(channels[0][0]), "tokens": tokens, "channels": channels, "scores": scores,
    }))
    return path


def read_model_file(path: str | Path, what: str, fix: str, instead: str) -> tuple[Path, dict]:
    """A per-model JSON file written offline (a calibration, a head profile) as a dict; a missing or
    unreadable one is an error naming `fix` (the command that writes it) and `instead` (a flag)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SparsetuneError(f"{what} {path} does not exist; {fix} or pass {instead}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SparsetuneError(f"{what} {path} is not readable JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise SparsetuneError(f"{what} {path} is not a JSON object; {fix}")
    return path, data


def load_calibration(
    path: str | Path, num_layers: int, num_kv_heads: int, head_dim: int, model: str | None = None
) -> Calibration:
    """The channel order of a calibration file, checked against the model's shapes."""
    fix = f"re-run `sparsetune flows calibrate --model {model or 'MODEL'}`"
    path, data = read_model_file(path, "calibration file", fix, "--param calibration=FILE")
    want = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    bad = [f"{k} {data.get(k)} (the model has {v})" for k, v in want.items() if data.get(k) != v]
    if bad:
        raise SparsetuneError(f"calibration file {path} does not fit the model: {', '.join(bad)}; {fix}")
    channels, every = data.get("channels"), list(range(head_dim))
    if not (
        isinstance(channels, list) and len(channels) == num_layers
        and all(isinstance(heads, list) and len(heads) == num_kv_heads for heads in channels)
        and all(isinstance(c, list) and all(isinstance(i, int) for i in c) and sorted(c) == every
                for heads in channels for c in heads)
    ):
        raise SparsetuneError(f"calibration file {path}: `channels` must hold a permutation of the {head_dim} "
                              f"channel indices per layer and KV head; {fix}")
    return channels


def resolve_calibration(
    flow: DecodeFlow, model: str, random_weights: bool, num_layers: int, num_kv_heads: int, head_dim: int
) -> Calibration:
    """The channel order a calibrated flow runs with on `model`: its `calibration` file, or for
    "auto" the model's default file (which must exist: calibration is an explicit, offline step)."""
    if flow.calibration != "auto":
        return load_calibration(flow.calibration, num_layers, num_kv_heads, head_dim, model)
    path = default_path(model, random_weights)
    if not path.is_file():
        cmd = f"sparsetune flows calibrate --model {model}" + (" --random-weights" if random_weights else "")
        raise SparsetuneError(f"{flow.name} needs channel calibration for {model}: run `{cmd}` "
                              f"(or pass --param calibration=FILE)")
    return load_calibration(path, num_layers, num_kv_heads, head_dim, model)


def synthetic_calibration(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> Calibration:
    """A seeded random channel order, for checking a calibrated flow without a model."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randperm(head_dim, generator=g).tolist() for _ in range(num_kv_heads)] for _ in range(num_layers)]
