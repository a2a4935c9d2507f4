"""Per-model files written offline and read when a flow runs: where they live, how they are read
and checked against the model's shapes (the one place for both).

- **channel calibration** (`kind` "calibration", DoubleSparse): written by
  `sparsetune.calibration.channels`. JSON:

      {"model", "statistic", "num_layers", "num_kv_heads", "head_dim", "tokens",
       "channels": [layer][kv_head] → channel indices, most important first,
       "scores":   [layer][kv_head][channel] → the statistic of that channel}

- **head profile** (`kind` "head_classes", RedKnot): written by `sparsetune.calibration.heads`.
  JSON: {"model", "method", "num_layers", "num_kv_heads", "sink", "window", "chunks",
  "chunk_tokens", "prefix_shift", "edge_mass", "scores": [layer][kv_head] → float}

- **tuned defaults** (`kind` "defaults"): a flow's params picked for this model, written by
  `sparsetune search --save-defaults`; shipped ones (measured tables) in `sparsetune/data/defaults/`.
  JSON: {"model", "flows": {flow name: {"params": {name: value string}, "source": {...}}}}
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from sparsetune.errors import SparsetuneError
from sparsetune.models.registry import models_dir

CALIBRATION = "calibration"
HEAD_CLASSES = "head_classes"
DEFAULTS = "defaults"
SHIPPED_DEFAULTS = Path(__file__).resolve().parents[1] / "data" / "defaults"

Calibration = list[list[list[int]]]  # [layer][kv_head] → channel indices, most important first


def artifact_path(model: str, random_weights: bool = False, kind: str = "calibration") -> Path:
    """`<cache>/<kind>/<model>.json` (kind: "calibration", or "head_classes" for RedKnot's head
    profile), next to the models cache (`SPARSETUNE_MODELS` moves both). A local model directory's
    path becomes one file name; a random-weight profile gets its own file, so it never stands in
    for the real weights'."""
    return models_dir().parent / kind / _file_name(model, random_weights)


def _file_name(model: str, random_weights: bool) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "--", model.strip("/\\"))
    return f"{stem}{'-random-weights' if random_weights else ''}.json"


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


def load_calibration(
    path: str | Path, num_layers: int, num_kv_heads: int, head_dim: int, model: str | None = None,
    fix: str | None = None,
) -> Calibration:
    """The channel order of a calibration file, checked against the model's shapes; `fix`: what an
    error tells the user to do (default: calibrate the model again)."""
    fix = fix or f"re-run `sparsetune flows calibrate --model {model or 'MODEL'}`"
    path, data = read_model_file(path, "calibration file", fix, "--param calibration=FILE")
    return _channels(path, data, num_layers, num_kv_heads, head_dim, fix)


def _channels(path: Path, data: dict, num_layers: int, num_kv_heads: int, head_dim: int, fix: str) -> Calibration:
    """A read calibration file's channel order, checked against the model's shapes."""
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


def calibration_path(spec: str, flow: str, model: str | None, random_weights: bool = False) -> Path:
    """The calibration file a calibrated flow `flow` reads: the file `spec`, or for "auto" the
    model's default file (which must exist: calibration is an explicit, offline step)."""
    if spec != "auto":
        return Path(spec).expanduser()
    if model is None:
        raise SparsetuneError(f"{flow} reads the channel calibration of the model it runs on: name the model "
                              "(--model M) or pass --param calibration=FILE")
    path = artifact_path(model, random_weights, CALIBRATION)
    if not path.is_file():
        cmd = f"sparsetune flows calibrate --model {model}" + (" --random-weights" if random_weights else "")
        raise SparsetuneError(f"{flow} needs channel calibration for {model}: run `{cmd}` "
                              f"(or pass --param calibration=FILE)")
    return path


def resolve_calibration(
    spec: str, flow: str, model: str, random_weights: bool, num_layers: int, num_kv_heads: int, head_dim: int
) -> Calibration:
    """The channel order the calibrated flow `flow` runs with on `model` (`calibration_path`),
    checked against the model's shapes."""
    return load_calibration(calibration_path(spec, flow, model, random_weights), num_layers, num_kv_heads, head_dim,
                            model)


def calibration_shape(path: str | Path) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) a calibration file is for, the file checked as `load_calibration`
    checks it against those shapes (a file carried without its model: a bundle's)."""
    fix = "re-run `sparsetune flows calibrate`"
    path, data = read_model_file(path, "calibration file", fix, "--param calibration=FILE")
    shape = tuple(data.get(k) for k in ("num_layers", "num_kv_heads", "head_dim"))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise SparsetuneError(f"calibration file {path}: num_layers, num_kv_heads and head_dim must be positive "
                              f"integers; {fix}")
    _channels(path, data, *shape, fix)
    return shape  # type: ignore[return-value]


def synthetic_calibration(num_layers: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> Calibration:
    """A seeded random channel order, for checking a calibrated flow without a model."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randperm(head_dim, generator=g).tolist() for _ in range(num_kv_heads)] for _ in range(num_layers)]


SCORES = ("scores", "edge_mass", "prefix_shift")  # what a flow may rank heads by ("scores": RedKnot's max)


def load_head_scores(path: str | Path, num_layers: int, num_kv_heads: int, model: str | None = None,
                     key: str = "scores") -> torch.Tensor:
    """The `[layers, kv_heads]` scores (`key`: one of SCORES) of a head profile file, checked against
    the model's shapes."""
    fix = f"re-run `sparsetune flows profile-heads --model {model or 'MODEL'}`"
    path, data = read_model_file(path, "head profile", fix, "--reuse-param head_classes=FILE")
    scores = data.get(key)
    if not (isinstance(scores, list) and len(scores) == num_layers
            and all(isinstance(row, list) and len(row) == num_kv_heads and all(isinstance(x, (int, float)) for x in row)
                    for row in scores)):
        raise SparsetuneError(f"head profile {path} does not fit the model ({num_layers} layers x {num_kv_heads} "
                              f"KV heads of numeric `{key}`); {fix}")
    return torch.tensor(scores, dtype=torch.float64)


def resolve_head_scores(spec: str, model: str, random_weights: bool, num_layers: int, num_kv_heads: int,
                        key: str = "scores") -> torch.Tensor:
    """The head scores a flow runs with: its file, or for "auto" the model's default profile."""
    if spec != "auto":
        return load_head_scores(spec, num_layers, num_kv_heads, model, key)
    path = artifact_path(model, random_weights, HEAD_CLASSES)
    if not path.is_file():
        cmd = f"sparsetune flows profile-heads --model {model}" + (" --random-weights" if random_weights else "")
        raise SparsetuneError(f"redknot needs head classes for {model}: run `{cmd}` (or pass --reuse-param head_classes=FILE)")
    return load_head_scores(path, num_layers, num_kv_heads, model, key)


# ---- tuned defaults ----------------------------------------------------------------------------------

def _defaults_file(path: Path) -> dict[str, dict]:
    fix = "delete it, or write it again with `sparsetune search ... --save-defaults`"
    _path, data = read_model_file(path, "tuned defaults file", fix, "--defaults published")
    flows = data.get("flows")
    if not (isinstance(flows, dict) and all(
            isinstance(e, dict) and isinstance(e.get("params"), dict) and isinstance(e.get("source", {}), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in e["params"].items()) for e in flows.values())):
        raise SparsetuneError(f"tuned defaults file {path}: `flows` must map each flow to {{\"params\": {{name: string}}, "
                              f"\"source\": {{...}}}}; {fix}")
    return {name: {"params": dict(e["params"]), "source": dict(e.get("source", {})), "file": str(path)}
            for name, e in flows.items()}


def read_tuned_defaults(model: str, random_weights: bool = False) -> dict[str, dict]:
    """The model's tuned defaults per flow ({"params", "source", "file"}): the user's file (written by
    `search --save-defaults`) over the shipped one, flow by flow; none for other models."""
    out: dict[str, dict] = {}
    for path in (SHIPPED_DEFAULTS / _file_name(model, random_weights), artifact_path(model, random_weights, DEFAULTS)):
        if path.is_file():
            out.update(_defaults_file(path))
    return out


def save_tuned_defaults(model: str, random_weights: bool, flow: str, params: dict[str, str],
                        source: dict[str, Any]) -> Path:
    """Make `params` the model's tuned defaults for `flow` in the user's file (other flows kept)."""
    path = artifact_path(model, random_weights, DEFAULTS)
    flows = {k: {"params": v["params"], "source": v["source"]} for k, v in _defaults_file(path).items()} \
        if path.is_file() else {}
    flows[flow] = {"params": {k: str(v) for k, v in params.items()}, "source": source}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model, "flows": flows}, indent=1) + "\n")
    tmp.replace(path)
    return path
