"""Turn `--model NAME_OR_PATH [--random-weights]` into a config, a weight source and a tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sparsetune.errors import SparsetuneError
from sparsetune.models.config import ModelConfig
from sparsetune.models.registry import (
    REGISTRY,
    ModelSpec,
    find_local_weights,
    get_spec,
    gguf_available,
    gguf_path,
    missing_weights_error,
    models_dir,
)
from sparsetune.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, has_tokenizer_files


@dataclass
class ResolvedModel:
    name: str
    config: ModelConfig
    weights_dir: Path | None  # None: random weights
    tokenizer_dir: Path | None
    spec: ModelSpec | None
    random_weights: bool

    def load_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer; bytes for random-weight runs without one; None if absent."""
        if self.tokenizer_dir is not None and has_tokenizer_files(self.tokenizer_dir):
            return HFTokenizer(self.tokenizer_dir, self.config.eos_token_ids)
        if self.random_weights:
            return ByteTokenizer(self.config.eos_token_ids)
        return None


def _local_dir(name_or_path: str) -> Path | None:
    """The directory `--model` names, or None for a registry name."""
    path = Path(name_or_path).expanduser()
    if name_or_path.lower() not in REGISTRY and (path.is_dir() or "/" in name_or_path or name_or_path.startswith(".")):
        return path
    return None


def _check_local_dir(path: Path, random_weights: bool) -> ModelConfig:
    if not path.is_dir():
        raise SparsetuneError(f"model directory {path} does not exist; pass a registered name (sparsetune models list) "
                              "or an HF-format directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise SparsetuneError(f"{path} has no config.json; expected an HF-format model directory")
    config = ModelConfig.from_json_file(cfg_file)
    if not random_weights and not any(path.glob("*.safetensors")):
        raise SparsetuneError(f"no *.safetensors files in {path}; pass --random-weights for a speed-only run")
    return config


def model_name(name_or_path: str) -> str:
    """The name runs record a model under (and its tuned defaults and calibrations are filed by): a
    local directory's path, a registered model's own name; anything else as given. Checks nothing."""
    path = _local_dir(name_or_path)
    if path is not None:
        return str(path)
    spec = REGISTRY.get(name_or_path.lower())
    return name_or_path if spec is None else spec.name


def model_config(name_or_path: str, random_weights: bool = False) -> tuple[str, ModelConfig]:
    """The model's name and architecture, checked without loading or converting anything (no torch):
    what argument checks need before an engine is built."""
    path = _local_dir(name_or_path)
    if path is not None:
        return str(path), _check_local_dir(path, random_weights)
    spec = get_spec(name_or_path)
    if spec.gguf_package:
        if not random_weights:
            gguf_path(spec)  # the package is installed and holds its file
    elif not random_weights:
        directory, looked = find_local_weights(spec)
        if directory is None:
            raise missing_weights_error(spec, looked)
    return spec.name, spec.config


def resolve_model(name_or_path: str, random_weights: bool = False) -> ResolvedModel:
    from sparsetune.models.weights import materialize_gguf

    path = _local_dir(name_or_path)
    if path is not None:
        config = _check_local_dir(path, random_weights)
        return ResolvedModel(str(path), config, None if random_weights else path, path, None, random_weights)

    spec = get_spec(name_or_path)
    if spec.gguf_package:
        if random_weights and not gguf_available(spec):
            # Speed-only runs need only the architecture, e.g. on a GPU host without the package.
            return ResolvedModel(spec.name, spec.config, None, None, spec, True)
        # The embedded default: the package ships with the install.
        directory = materialize_gguf(gguf_path(spec), models_dir())
        config = ModelConfig.from_json_file(directory / "config.json")
        return ResolvedModel(spec.name, config, None if random_weights else directory, directory, spec, random_weights)
    directory, looked = find_local_weights(spec)
    if directory is None:
        if random_weights:
            return ResolvedModel(spec.name, spec.config, None, None, spec, True)
        raise missing_weights_error(spec, looked)
    config = ModelConfig.from_json_file(directory / "config.json")
    return ResolvedModel(spec.name, config, None if random_weights else directory, directory, spec, random_weights)


def hf_dir(name_or_path: str, random_weights: bool = False) -> Path:
    """An HF-format folder of the model that other engines (SGLang, transformers) load: a local
    directory as given; the embedded default's copy converted from its GGUF (float32, with its
    tokenizer); a registered model's local weights. With `random_weights` and no weights, a folder
    holding only the registered config.json (bfloat16), for SGLang's `--load-format dummy`."""
    path = _local_dir(name_or_path)
    if path is not None:
        _check_local_dir(path, random_weights)
        return path
    model_config(name_or_path, random_weights)  # what is missing, said before torch loads
    resolved = resolve_model(name_or_path, random_weights)
    if resolved.tokenizer_dir is not None:
        return resolved.tokenizer_dir
    spec = resolved.spec
    out = models_dir() / f"{spec.name}-config"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**spec.hf_config, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    return out
