"""What determines an evaluation run (`EvalConfig`), and the checks it passes before anything runs.

`EvalConfig` checks its values when it is built; `check_config` checks what needs files (task
files, the model's config) but no torch and no weights: the CLI calls it before the heavy imports,
so a bad argument fails in a fraction of a second, and `evaluate` calls it before it builds an
engine or creates a run directory, so a refused run leaves nothing on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from sparsetune.errors import SparsetuneError
from sparsetune.records import read_run_config
from sparsetune.setup import FLOW_OPTIONS, ENGINE_FIELDS, Setup, resolve, resolve_options, setup_field

MODES = ("auto", "accuracy", "speed", "all")
DEFAULT_SPEED_TOKENS = 128
# config.json's version. /3: the run's resolved `Setup` as "setup"; /2 had the engine options with
# the flows' names and raw params as "engine", /1 had them inline in "eval" (both read by resume).
CONFIG_SCHEMA = "sparsetune.eval.config/3"
SetupField = setup_field()
class EvalConfig(BaseModel):
    """Everything that determines a run; written to config.json and read back by `resume`.

    `setup`: the resolved setup (`sparsetune.setup`): the model, device, dtype, weights, the decode
    and reuse flows with their params, executor, CUDA graphs, KV memory (None: sized to the work) and
    the seed (tasks, speed prompts, random weights). The run sets its batch limits from `batch`
    (`evaluation.runner.run_engine_config`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    setup: SetupField = Setup()
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
        if self.setup.engine.random_weights and self.mode in ("accuracy", "all"):
            raise SparsetuneError("accuracy needs real weights: drop --random-weights, or pass --mode speed")
        return self

    @classmethod
    def of(cls, **options: Any) -> EvalConfig:
        """From flat keyword options, as `sparsetune.eval` takes them: the eval's own fields, and the
        setup's (`setup.FLOW_OPTIONS` and `EngineConfig`'s), resolved here (`setup.resolve_options`)."""
        own = set(cls.model_fields) - {"setup"}
        unknown = [k for k in options if k not in own and k not in FLOW_OPTIONS and k not in ENGINE_FIELDS]
        if unknown:
            raise TypeError(f"unknown eval option {unknown[0]!r}")
        setup = resolve_options(**{k: v for k, v in options.items() if k not in own})
        return cls(setup=setup, **{k: v for k, v in options.items() if k in own})

    def speed_only(self) -> bool:
        """No accuracy passes: speed mode, or auto with random weights."""
        return self.mode == "speed" or self.mode == "auto" and self.setup.engine.random_weights


def check_config(cfg: EvalConfig) -> None:
    """Every check that needs neither torch nor the model's weights: names, task files, the
    engine options, the model's existence and context length."""
    from sparsetune.evaluation.tasks import task_lengths

    lengths = task_lengths(cfg.tasks, cfg.context)  # unknown tasks and bad files fail here
    name, mcfg = cfg.setup.engine.check()  # the options' rules; the model exists: its name, architecture
    max_len = mcfg.max_position_embeddings
    needs = [] if cfg.speed_only() else [(prompt, cfg.max_new_tokens or gen, what) for what, prompt, gen in lengths]
    if cfg.mode in ("speed", "all") or cfg.speed_only():  # auto: the device decides; the runner checks it before it starts
        needs.append((cfg.context, cfg.max_new_tokens or DEFAULT_SPEED_TOKENS, "the speed prompts"))
    for prompt, gen, what in needs:
        if prompt + gen > max_len:
            raise SparsetuneError(
                f"{what}: {prompt} prompt tokens + {gen} generated exceed {name}'s context length of {max_len}; "
                f"lower --context (or --max-new-tokens)")


# What a resumed run's saved config must hold (schema /2 and /1), with the JSON types each takes: every
# field of the eval and the engine options an eval sets. A field left out would be filled in by
# today's default, and a different evaluation would run into the folder. /3 holds a `Setup`.
RESUME_ENGINE_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,), "device": (str, type(None)), "dtype": (str, type(None)), "random_weights": (bool,),
    "flow": (str, type(None)), "flow_params": (dict,), "reuse": (str, type(None)), "reuse_params": (dict,),
    "kv_memory": (int, type(None)), "flow_executor": (str, type(None)), "cuda_graph": (bool,), "seed": (int,),
}


def load_resume_config(run_dir: Path) -> EvalConfig:
    """The config of an interrupted run (its `config.json`), complete and valid, or one error naming
    what is wrong with it."""
    from pydantic import ValidationError

    what = "pass a run directory made by sparsetune eval"
    raw = read_run_config(run_dir, "sparsetune eval")
    block = raw.get("eval") if isinstance(raw, dict) else None
    if not isinstance(block, dict):
        raise SparsetuneError(f"--resume {run_dir}: config.json is not an eval run's config (it has no \"eval\" "
                              f"object); {what}")
    problem = _resume_problem(block)
    if problem is None:
        try:
            return EvalConfig.model_validate(block) if "setup" in block else _from_v2(block)
        except ValidationError as e:  # pydantic's report spans lines: one line of "field: problem"
            problem = "is invalid (" + "; ".join(f"{'.'.join(map(str, x['loc'])) or 'eval'}: {x['msg']}"
                                                 for x in e.errors()) + ")"
        except (SparsetuneError, TypeError, ValueError) as e:  # a value the config refuses, an unknown key
            problem = f"is invalid ({e})"
    raise SparsetuneError(f"--resume {run_dir}: config.json {problem}: not a resumable eval run; {what}")


def _resume_problem(block: dict[str, Any]) -> str | None:
    """What makes a saved eval block incomplete (the first missing field) or ill-typed; None: neither.
    /3 holds "setup" (checked by `Setup.from_dict`); /2 had "engine"; /1 had the engine options inline,
    the flow's params as `params`."""
    missing = [k for k in EvalConfig.model_fields if k != "setup" and k not in block]
    if "setup" in block:
        return f"lacks {missing[0]!r}" if missing else None
    engine, names = (block.get("engine"), {}) if "engine" in block else (block, {"flow_params": "params"})
    if not isinstance(engine, dict):
        return f"has {engine!r} for 'engine', not an object"
    missing += [names.get(k, k) for k in RESUME_ENGINE_FIELDS if names.get(k, k) not in engine]
    if missing:
        return f"lacks {missing[0]!r}" + (f" (and {len(missing) - 1} more fields)" if len(missing) > 1 else "")
    for key, types in RESUME_ENGINE_FIELDS.items():
        value = engine[names.get(key, key)]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            return f"has {value!r} for {names.get(key, key)!r}, not {' or '.join(_JSON_TYPES[t] for t in types)}"
    return None


def _from_v2(block: dict[str, Any]) -> EvalConfig:
    """A /2 or /1 eval block: its flows were saved with the tuned defaults already merged into their
    params, so they resolve again as published ("dense" stays dense)."""
    from sparsetune.engine.config import EngineConfig

    engine = dict(block["engine"]) if "engine" in block else {k: v for k, v in block.items() if k in RESUME_ENGINE_FIELDS}
    if "engine" not in block:
        engine["flow_params"] = block.get("params") or {}
    flow, params = engine.pop("flow", None), engine.pop("flow_params", {})
    reuse, reuse_params = engine.pop("reuse", None), engine.pop("reuse_params", {})
    executor = engine.pop("flow_executor", None)
    if engine.get("block_size") == 16:  # /2 wrote its default: the flow's block size decides
        engine["block_size"] = None
    cfg = EngineConfig.from_dict(engine)
    setup = resolve(cfg, flow=flow, params=params, reuse=reuse, reuse_params=reuse_params, executor=executor,
                    defaults="published")
    return EvalConfig(setup=setup, **{k: block[k] for k in EvalConfig.model_fields if k != "setup"})


_JSON_TYPES = {str: "a string", type(None): "null", bool: "true or false", dict: "an object", int: "an integer"}
