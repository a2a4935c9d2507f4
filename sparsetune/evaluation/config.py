"""What determines an evaluation run (`EvalConfig`), and the checks it passes before anything runs.

`EvalConfig` checks its values when it is built; `check_config` checks what needs files (task
files, the model's config) but no torch and no weights: the CLI calls it before the heavy imports,
so a bad argument fails in a fraction of a second, and `evaluate` calls it before it builds an
engine or creates a run directory, so a refused run leaves nothing on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from sparsetune.engine.config import EngineConfig, split_engine_options
from sparsetune.engine.config_field import EngineField
from sparsetune.errors import SparsetuneError

MODES = ("auto", "accuracy", "speed", "all")
DEFAULT_SPEED_TOKENS = 128
# config.json's version; sparsetune.eval/1 had the engine options inline in "eval" (read by `EvalConfig.of`).
CONFIG_SCHEMA = "sparsetune.eval.config/2"
class EvalConfig(BaseModel):
    """Everything that determines a run; written to config.json and read back by `resume`.

    `engine`: model, device, dtype, weights, the decode flow (None: dense, or the reuse flow's own;
    "dense" stays dense) and the reuse flow with their parameters, executor, CUDA graphs, KV memory
    (None: sized to the work) and the seed (tasks, speed prompts, random weights). The run sets its
    batch limits from `batch` (`evaluation.runner.run_engine_config`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: EngineField = EngineConfig()
    tasks: tuple[str, ...] | None = None  # None: the default suite
    context: int = 1024
    samples: int = 4  # per generated task
    batch: int = 8
    max_new_tokens: int | None = None  # None: each task's own length (speed: 128)
    mode: str = "auto"
    fidelity: bool = True
    limit: int | None = None  # at most this many samples per task (generated and files); None: all

    @field_validator("tasks", mode="before")
    @classmethod
    def _no_tasks_is_default(cls, tasks: Any) -> Any:
        return tasks or None

    @model_validator(mode="after")
    def _check_values(self) -> EvalConfig:
        for name, value, low in (("--context", self.context, 16), ("--samples", self.samples, 1), ("--batch", self.batch, 1),
                                 ("--max-new-tokens", self.max_new_tokens, 1), ("--limit", self.limit, 1)):
            if value is not None and value < low:
                raise SparsetuneError(f"{name} must be at least {low} (got {value})")
        if self.mode not in MODES:
            raise SparsetuneError(f"--mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.engine.random_weights and self.mode in ("accuracy", "all"):
            raise SparsetuneError("accuracy needs real weights: drop --random-weights, or pass --mode speed")
        return self

    @classmethod
    def of(cls, **options: Any) -> EvalConfig:
        """From flat keyword options, as `sparsetune.eval` takes them: the eval's own fields and
        `EngineConfig`'s, with `params` for the decode flow's `flow_params`."""
        if "params" in options:
            options["flow_params"] = dict(options.pop("params") or {})
        engine, own = split_engine_options(options, set(cls.model_fields) - {"engine"}, "eval")
        return cls(engine=engine, **own)

    def speed_only(self) -> bool:
        """No accuracy passes: speed mode, or auto with random weights."""
        return self.mode == "speed" or self.mode == "auto" and self.engine.random_weights


def check_config(cfg: EvalConfig) -> None:
    """Every check that needs neither torch nor the model's weights: names, task files, the
    engine options, the model's existence and context length."""
    from sparsetune.evaluation.tasks import task_lengths

    lengths = task_lengths(cfg.tasks, cfg.context)  # unknown tasks and bad files fail here
    name, mcfg = cfg.engine.check()  # the options' rules; the model exists: its name, architecture
    max_len = mcfg.max_position_embeddings
    needs = [] if cfg.speed_only() else [(prompt, cfg.max_new_tokens or gen, what) for what, prompt, gen in lengths]
    if cfg.mode in ("speed", "all") or cfg.speed_only():  # auto: the device decides; the runner checks it before it starts
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
        block = raw.get("eval", {})
        return EvalConfig.model_validate(block) if "engine" in block else EvalConfig.of(**block)
    except (OSError, ValueError, TypeError) as e:  # JSON, the schema (a pydantic ValidationError), unknown keys
        raise SparsetuneError(f"--resume {run_dir}: config.json is unreadable ({e})") from None
