"""Architecture description of a decoder model, independent of where weights come from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError

# HF `architectures` / `model_type` values the engine implements. Llama covers
# SmolLM2 and Llama 3.x (with llama3 RoPE scaling); Qwen2 adds qkv bias; Qwen3
# adds per-head q/k RMSNorm and drops the bias.
# The HF model class of each, which configs name in `architectures` (SGLang picks its class from it).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h
        return L * per_layer + emb + (0 if self.tie_word_embeddings else emb) + h

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str = "the model config") -> "ModelConfig":
        """Build from a HF `config.json` dict (or an object's `to_dict()`); `where` names it in errors."""
        model_type = str(hf.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = hf.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else model_type or "unknown"
            raise SparsetuneError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                f"supported: {', '.join(ARCHITECTURES.values())}"
            )
        heads = _count(hf, "num_attention_heads", where)
        hidden = _count(hf, "hidden_size", where)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if any(isinstance(e, bool) or not isinstance(e, int) for e in eos_ids):
            raise SparsetuneError(f"{where}: eos_token_id must be a token id or a list of them (got {eos!r}); {_FIX}")
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers 5 moves rope settings into `rope_parameters`.
        rope_params = hf.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") not in ("default", None):
                rope_scaling = rope_params
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise SparsetuneError(f"{where}: rope_scaling must be a JSON object or null (got {rope_scaling!r}); {_FIX}")
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type in (None, "default"):
                rope_scaling = None
            elif rope_type != "llama3":
                raise SparsetuneError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3"
                )
        kv_heads = _count(hf, "num_key_value_heads", where, heads)
        if heads % kv_heads:
            raise SparsetuneError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                                  f"({kv_heads}); {_FIX}")
        return cls(
            model_type=model_type,
            vocab_size=_count(hf, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_count(hf, "intermediate_size", where),
            num_hidden_layers=_count(hf, "num_hidden_layers", where),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_count(hf, "head_dim", where, hidden // heads),
            max_position_embeddings=_count(hf, "max_position_embeddings", where, 4096),
            rms_norm_eps=_number(hf, "rms_norm_eps", where, 1e-6),
            rope_theta=_number({"rope_theta": rope_theta}, "rope_theta", where, 10000.0),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama may declare it.
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )

    @classmethod
    def from_json_file(cls, path: Path) -> "ModelConfig":
        """From a model folder's config.json; a file that is not UTF-8 JSON of an HF config, or whose
        fields are not what they must be, is one error naming the file."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise SparsetuneError(f"cannot read the model config {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise SparsetuneError(f"{path} is not UTF-8 ({e.reason} at byte {e.start}); {_FIX}") from None
        except json.JSONDecodeError as e:
            raise SparsetuneError(f"{path} is not valid JSON ({e}); {_FIX}") from None
        if not isinstance(data, dict):
            raise SparsetuneError(f"{path} is not a JSON object of an HF model config; {_FIX}")
        return cls.from_hf(data, str(path))


_FIX = "fix the file or pass another --model"


def _count(hf: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    """A size or count of an HF config (absent or null: `default`): a positive integer. A string, a
    fraction or a count below 1 is a broken config, refused by name before anything is sized by it."""
    value = hf.get(key)
    value = default if value is None else value
    if value is None:
        raise SparsetuneError(f"{where} lacks {key}; {_FIX}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SparsetuneError(f"{where}: {key} must be a positive integer (got {value!r}); {_FIX}")
    return value


def _number(hf: dict[str, Any], key: str, where: str, default: float) -> float:
    """A positive finite real of an HF config (absent or null: `default`): the norm epsilon, the RoPE base."""
    value = hf.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise SparsetuneError(f"{where}: {key} must be a positive number (got {value!r}); {_FIX}")
    return float(value)
