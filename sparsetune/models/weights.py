"""Weight loading: HF safetensors directories, GGUF (converted once to HF format), seeded random."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from sparsetune.errors import SparsetuneError
from sparsetune.models.config import ARCHITECTURES

# HF parameter name fragment → (our fused parameter, which shard of it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str) -> tuple[str, int] | None:
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _FUSED:
            fused, shard = _FUSED[p]
            return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
    return None


def _shard_slices(model: nn.Module, fused_name: str) -> list[slice]:
    """Row ranges of each shard inside a fused q/k/v or gate/up parameter."""
    cfg = model.config  # type: ignore[attr-defined]
    if "qkv_proj" in fused_name:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def load_state_dict_into(model: nn.Module, tensors: "dict[str, torch.Tensor] | _LazyTensors") -> None:
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up; every parameter must be filled."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for name in tensors.keys():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:  # type: ignore[attr-defined]
            continue
        if "rotary_emb" in name:
            continue
        t = tensors[name]
        fused = _fused_target(name)
        if fused is not None:
            target, shard = fused
            dst = params.get(target)
            if dst is None:
                raise SparsetuneError(f"checkpoint tensor {name} has no place in the model")
            with torch.no_grad():
                dst[_shard_slices(model, target)[shard]].copy_(t)
            filled.add(f"{target}#{shard}")
            continue
        dst = params.get(name)
        if dst is None:
            raise SparsetuneError(f"checkpoint tensor {name} has no place in the model (wrong architecture?)")
        if dst.shape != t.shape:
            raise SparsetuneError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t)
        filled.add(name)
    missing = []
    for name, p in model.named_parameters():
        if any(k in name for k in ("qkv_proj", "gate_up_proj")):
            n = 3 if "qkv_proj" in name else 2
            if any(f"{name}#{i}" not in filled for i in range(n)):
                missing.append(name)
        elif name not in filled:
            missing.append(name)
    if missing:
        raise SparsetuneError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")


class _LazyTensors:
    """All tensors of a directory's *.safetensors files, read one at a time."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._files = sorted(directory.glob("*.safetensors"))
        if not self._files:
            raise SparsetuneError(f"no *.safetensors files in {directory}; only safetensors checkpoints are supported")
        self._where: dict[str, Path] = {}
        for f in self._files:
            with _reading(f):
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self._where[k] = f

    def keys(self) -> list[str]:
        return list(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._where[name]
        with _reading(f):
            with safe_open(str(f), framework="pt") as h:
                t = h.get_tensor(name)
        # HF checkpoints prefix the base model with "model."; we keep the same names.
        return t


@contextmanager
def _reading(file: Path) -> Iterator[None]:
    """A weights file that safetensors cannot read (cut short by a download, overwritten, not
    safetensors at all) is one error naming it and the fix."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        raise SparsetuneError(f"cannot read the weights file {file}: it is incomplete or damaged ({e}); download "
                              "the model again, or pass --random-weights for a speed-only run") from None


def load_safetensors_dir(model: nn.Module, directory: Path) -> None:
    load_state_dict_into(model, _LazyTensors(directory))


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> None:
    """Seeded random weights with activations kept O(1): N(0, 1/fan_in) matrices, unit norms."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)
        elif "embed_tokens" in name:
            p.normal_(0.0, 1.0, generator=gen)
        else:
            p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)


def _name_architecture(config_file: Path) -> None:
    """Write `architectures` into a converted copy's config.json where it is missing (SGLang and
    transformers' Auto classes pick the model class from it): the class of its `model_type`."""
    cfg = json.loads(config_file.read_text())
    if not cfg.get("architectures"):
        cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
        config_file.write_text(json.dumps(cfg, indent=2))


def materialize_gguf(gguf: Path, cache_root: Path) -> Path:
    """Convert a GGUF file once into an HF-format directory (dequantized, float32) and return it.

    transformers dequantizes GGUF on every load (~30 s for SmolLM2, mostly the
    tokenizer conversion); the converted copy loads in about a second.
    """
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
    out = cache_root / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        _name_architecture(out / "config.json")  # a copy converted before architectures were written
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".converting-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-loaded models; the dequantized tensors are plain, so write them.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_cfg = hf.config.to_dict()
        hf_cfg.pop("quantization_config", None)
        hf_cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        _name_architecture(tmp / "config.json")  # GGUF-loaded configs lack it
        tok.save_pretrained(str(tmp))
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
            return out
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
