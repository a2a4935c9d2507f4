"""What determines an evaluation run (`EvalConfig`), and the checks it passes before anything runs.

`check_config` imports no torch and loads no model: the CLI calls it before the heavy imports, so
a bad argument fails in a fraction of a second, and `evaluate` calls it before it builds an engine or
creates a run directory, so a refused run leaves nothing on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.models.registry import DEFAULT_MODEL

MODES = ("auto", "accuracy", "speed", "all")
DEFAULT_SPEED_TOKENS = 128


@dataclass
class EvalConfig:
    """Everything that determines a run; written to config.json and read back by `resume`."""

    flow: str = "dense"
    model: str = DEFAULT_MODEL
    tasks: list[str] | None = None  # None: the default suite
    context: int = 1024
    samples: int = 4  # per generated task
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict)  # --param strings (or typed values from Python)
    batch: int = 8
    max_new_tokens: int | None = None  # None: each task's own length (speed: 128)
    mode: str = "auto"
    fidelity: bool = True
    device: str = "auto"
    dtype: str = "auto"
    random_weights: bool = False
    kv_memory: int | None = None
    flow_executor: str | None = None
    cuda_graph: bool = True
    reuse: str | None = None  # KV-reuse flow for tasks with segments (rag)
    reuse_params: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None  # at most this many samples per task (generated and files); None: all


def check_config(cfg: EvalConfig) -> None:
    """Every check that needs neither torch nor the model's weights: sizes, names, task files, the
    model's existence and context length."""
    from sparsetune.engine.config import EngineConfig
    from sparsetune.evaluation.tasks import task_lengths

    for name, value, low in (("--context", cfg.context, 16), ("--samples", cfg.samples, 1), ("--batch", cfg.batch, 1),
                             ("--max-new-tokens", cfg.max_new_tokens, 1), ("--limit", cfg.limit, 1)):
        if value is not None and value < low:
            raise SparsetuneError(f"{name} must be at least {low} (got {value})")
    if cfg.mode not in MODES:
        raise SparsetuneError(f"--mode {cfg.mode!r}: use one of {', '.join(MODES)}")
    if cfg.random_weights and cfg.mode in ("accuracy", "all"):
        raise SparsetuneError("accuracy needs real weights: drop --random-weights, or pass --mode speed")
    lengths = task_lengths(cfg.tasks, cfg.context)  # unknown tasks and bad files fail here
    name, mcfg = EngineConfig(model=cfg.model, device=None if cfg.device == "auto" else cfg.device,
                              dtype=None if cfg.dtype == "auto" else cfg.dtype, kv_memory=cfg.kv_memory,
                              max_num_seqs=cfg.batch, flow_executor=cfg.flow_executor,
                              random_weights=cfg.random_weights).check()  # the model exists: its name, architecture
    max_len = mcfg.max_position_embeddings
    speed_only = cfg.mode == "speed" or cfg.mode == "auto" and cfg.random_weights
    needs = [] if speed_only else [(prompt, cfg.max_new_tokens or gen, what) for what, prompt, gen in lengths]
    if cfg.mode in ("speed", "all") or speed_only:  # auto: the device decides; the runner checks it before it starts
        needs.append((cfg.context, cfg.max_new_tokens or DEFAULT_SPEED_TOKENS, "the speed prompts"))
    for prompt, gen, what in needs:
        if prompt + gen > max_len:
            raise SparsetuneError(
                f"{what}: {prompt} prompt tokens + {gen} generated exceed {name}'s context length of {max_len}; "
                f"lower --context (or --max-new-tokens)")


def load_resume_config(run_dir: Path) -> EvalConfig:
    """The config of an interrupted run (its `config.json`)."""
    if not run_dir.is_dir():
        raise SparsetuneError(f"--resume {run_dir}: no such directory; pass a run directory made by sparsetune eval")
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise SparsetuneError(f"--resume {run_dir}: no config.json there; pass a run directory made by sparsetune eval")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SparsetuneError(f"--resume {run_dir}: config.json is unreadable ({e})") from None
    known = EvalConfig.__dataclass_fields__
    return EvalConfig(**{k: v for k, v in raw.get("eval", {}).items() if k in known})
