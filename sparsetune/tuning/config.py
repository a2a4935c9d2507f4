"""What determines a search (`SearchConfig`), checked before torch loads.

A search keeps one Optuna study per flow under one name (Optuna cannot grow a categorical list
inside a study, and a flow's params are its own), all in one storage: by default a journal file
in the run folder (`runs/<study>/study.journal`, safe for several processes on one host), or an
RDB URL (`postgresql://...`) for workers on several hosts. The config is stored with the studies,
so `--resume` and `sparsetune search worker` read it back, and a rerun that changes what the
figures depend on is refused.
"""

from __future__ import annotations

import functools

import math
import re
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from sparsetune.errors import SparsetuneError
from sparsetune.records import DEFAULT_RUNS_DIR

DEFAULT_FLOWS = ("quest", "block_topk")
KINDS = ("decode", "reuse")
# A reuse search's defaults: every reuse workload (prompts whose bulk is reusable segments), and more
# samples per task than a decode search's, which has eight tasks.
REUSE_SAMPLES, REUSE_CONFIRM_SAMPLES = 4, 8
SPEEDS = ("auto", "measured", "modeled")
# What the figures depend on: a resumed study must agree on these.
FINGERPRINT = ("kind", "model", "flows", "tasks", "context", "samples", "batch", "seed", "params", "dtype", "speed",
               "speed_model", "speed_batch", "speed_context", "min_accuracy")
STORAGE_SCHEMES = ("postgresql", "sqlite")  # the databases a storage URL may name (`postgresql+psycopg://` too)
STORAGES = ("a journal file path (the default: runs/<study>/study.journal), postgresql://user:password@host/db "
            "(workers on several hosts; pip install -e '.[postgres]') or sqlite:///path.db")
MASK = "***"
# `scheme://user:password@host`: the password runs to the URL's last '@', so that an unquoted '@' in
# it leaves none of it in view (masking more than the password is the safe side)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*:)(?P<password>.*)@")
_QUERY_PASSWORD = re.compile(r"(?i)(?P<head>[?&]password=)(?P<password>[^&#]*)")


def masked_url(url: str, text: str | None = None) -> str:
    """`url` with its password (in the user info or a `password=` parameter) shown as `***`: all
    that a message, a log line or a run folder's file shows of a storage URL (the password stays
    where the storage is opened). With `text`, a message about `url` (a driver's): that text, with
    `url` masked and its password masked wherever else it occurs."""
    m = _USERINFO.match(url)
    shown = url if m is None else m["head"] + MASK + url[m.end("password"):]
    shown = _QUERY_PASSWORD.sub(lambda q: q["head"] + MASK, shown)
    if text is None:
        return shown
    secrets = ([m["password"]] if m else []) + [q["password"] for q in _QUERY_PASSWORD.finditer(url)]
    text = text.replace(url, shown)
    for secret in sorted({s for s in secrets if s and s != MASK}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def storage_scheme(url: str) -> str | None:
    """The database a storage URL names (postgresql, sqlite), or None for a journal file path; a URL
    of anything else is refused here, naming what is supported (and not the password)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", url)
    if m is None:
        return None
    scheme = m[1].split("+", 1)[0].lower()
    if scheme not in STORAGE_SCHEMES:
        raise SparsetuneError(f"--storage {masked_url(url)}: not a storage a search can use; use {STORAGES}")
    return scheme


def flow_key(flow: str) -> str:
    """A flow's name inside study names and records: the built-in name, or a flow file's stem."""
    return Path(flow).stem if flow.endswith(".py") else flow


class SearchConfig(BaseModel):
    """Everything that determines a search; stored in the study and read back by resume and workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str = "decode"  # decode flows (--flow) or reuse flows (--reuse): one kind per search
    model: str = "smollm2-135m"
    flows: tuple[str, ...] = DEFAULT_FLOWS
    tasks: tuple[str, ...] | None = None  # None: the default suite
    context: int = 1024
    samples: int = 1  # per generated task, for each trial (the search set)
    confirm_samples: int = 2  # per task, on fresh prompts, for each frontier point at the end
    confirm_defaults: bool = True  # each flow's defaults confirmed too (the report's "against the defaults")
    batch: int = 8
    params: dict[str, str] = {}  # fixed, not searched (--param): "key" for every flow, "flow:key" for one (`params_of`)
    min_accuracy: float | None = None  # relative to dense; a constraint
    trials: int | None = None  # across every flow's study and every worker
    hours: float | None = None
    study: str | None = None  # None: search-<timestamp>
    storage: str | None = None  # None: a journal file in the run folder
    out: str = str(DEFAULT_RUNS_DIR)
    seed: int = 0
    speed: str = "auto"  # measured on a GPU, modeled (`perf.cost`: measured per-operation costs) on CPU
    speed_model: str | None = None  # architecture speed is measured on (random weights); None: model
    speed_batch: int | None = None  # None: batch
    speed_context: int | None = None  # None: context
    device: str | None = None
    dtype: str | None = None
    save_defaults: bool = False  # the fastest confirmed point of each flow at --min-accuracy becomes the model's default
    quick_floor: float = 0.5  # the cascade: a point below this share of min_accuracy (or of dense) on the quick set stops there
    agent: str | None = None  # a proposer of new flows (`sparsetune.agents`): evolve, claude, openai
    agent_budget_usd: float | None = None  # proposing stops once the proposer's calls cost this much
    agent_model: str | None = None  # claude: the Anthropic model id; openai: the served model's name
    agent_endpoint: str | None = None  # openai: the server's base URL (e.g. http://localhost:30000/v1)

    def speed_kind(self) -> str:
        """measured or modeled: `speed`, where auto is measured on a GPU."""
        if self.speed != "auto":
            return self.speed
        from sparsetune.device import resolve_device

        return "measured" if resolve_device(self.device).type == "cuda" else "modeled"

    def speed_shape(self) -> tuple[str, bool, int, int]:
        """The model speed is taken on (random weights when it is not the search's), batch and
        context. Options given win; unset, the search's own, except a decode speed that is modeled
        over flows whose budget is a share of the context (no --param budget): then the shape the cost
        model is tested at (`perf.cost.Costs.shape`, Qwen3-8B at 16 x 32K, inside its fitted shapes),
        since a small model at a short context lies far outside its data."""
        model, batch, context = self.speed_model, self.speed_batch, self.speed_context
        if (self.kind == "decode" and model is None and batch is None and context is None
                and all(k.split(":", 1)[-1] != "budget" for k in self.params) and self.speed_kind() == "modeled"
                and _shares_of_context(self.flows)):
            from sparsetune.perf.cost import Costs

            model, batch, context = Costs.load().shape
        model = model or self.model
        return model, model != self.model, batch or self.batch, context or self.context

    def params_of(self, flow: str) -> dict[str, str]:
        """The `--param`s fixed for one flow (a searched flow's name or file, or a proposed flow's key):
        those for every flow, then its own (`--param flow:key=value`) over them."""
        from sparsetune.flow.params import params_per_flow

        keys = [flow_key(f) for f in self.flows]
        key = flow_key(flow)
        return params_per_flow(self.params, keys + ([key] if key not in keys else []))[key]

    def pinned(self) -> "SearchConfig":
        """This config with its speed shape written out (`speed_shape`), so the study's fingerprint
        holds the shape its speeds were taken at: a later run resolving it otherwise is refused."""
        model, random, batch, context = self.speed_shape()
        if self.kind != "decode" or (model, batch, context) == (self.model, self.batch, self.context):
            return self
        return self.model_copy(update={"speed_model": model, "speed_batch": batch, "speed_context": context})

    @field_validator("tasks", mode="before")
    @classmethod
    def _no_tasks_is_default(cls, tasks: Any) -> Any:
        return tasks or None

    @model_validator(mode="before")
    @classmethod
    def _reuse_defaults(cls, values: Any) -> Any:
        """A reuse search's tasks and samples, where not given: the reuse workloads, more samples."""
        if isinstance(values, dict) and values.get("kind") == "reuse":
            from sparsetune.evaluation.reuse_tasks import REUSE_TASKS

            values = {**values}
            for key, default in (("tasks", tuple(REUSE_TASKS)), ("samples", REUSE_SAMPLES),
                                 ("confirm_samples", REUSE_CONFIRM_SAMPLES)):
                if values.get(key) is None:
                    values[key] = default
        return values

    @model_validator(mode="after")
    def _check(self) -> SearchConfig:
        if self.kind not in KINDS:
            raise SparsetuneError(f"kind {self.kind!r}: a search is of decode flows (--flow) or reuse flows (--reuse)")
        if not self.flows:
            raise SparsetuneError("--flow: name at least one decode flow (e.g. --flow quest,block_topk)")
        for name, value, low in (("--context", self.context, 64), ("--samples", self.samples, 1),
                                 ("--confirm-samples", self.confirm_samples, 1), ("--batch", self.batch, 1),
                                 ("--trials", self.trials, 1), ("--speed-batch", self.speed_batch, 1),
                                 ("--speed-context", self.speed_context, 64)):
            if value is not None and value < low:
                raise SparsetuneError(f"{name} must be at least {low} (got {value})")
        if self.min_accuracy is not None and not 0 < self.min_accuracy <= 1:
            raise SparsetuneError(f"--min-accuracy is a share of dense accuracy in (0, 1] (got {self.min_accuracy}); "
                                  "e.g. --min-accuracy 0.95")
        if self.save_defaults and self.min_accuracy is None:
            raise SparsetuneError("--save-defaults needs --min-accuracy (the share of dense accuracy a saved default "
                                  "must keep on fresh prompts)")
        if self.save_defaults and self.kind == "reuse":
            raise SparsetuneError("--save-defaults: tuned defaults are for decode flows (eval and generate read them for "
                                  "--flow); run a reuse flow's confirmed point with --reuse-param k=v")
        if self.hours is not None and not 0 < self.hours < math.inf:
            raise SparsetuneError(f"--hours must be a positive number of hours (got {self.hours})")
        if self.storage is not None:
            storage_scheme(self.storage)
        if self.speed not in SPEEDS:
            raise SparsetuneError(f"--speed {self.speed!r}: use one of {', '.join(SPEEDS)}")
        if self.study is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", self.study):
            raise SparsetuneError(f"--study {self.study!r}: use letters, digits, '.', '_' and '-' (a folder name)")
        if self.agent is not None and self.kind != "decode":
            raise SparsetuneError("--agent writes decode flows; search reuse flows without it")
        if self.agent_budget_usd is not None and not 0 <= self.agent_budget_usd < math.inf:  # nan: never spent
            raise SparsetuneError(f"--agent-budget-usd must be a number of dollars, at least 0 (got {self.agent_budget_usd})")
        if not 0 <= self.quick_floor <= 1:
            raise SparsetuneError(f"quick_floor must be in [0, 1] (got {self.quick_floor})")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.out) / (self.study or "search")

    def fingerprint(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump(mode="json").items() if k in FINGERPRINT}

    def flow_arg(self, key: str) -> str:
        """The flow as the search was given it (a name or a file), from its key in records."""
        return next(f for f in self.flows if flow_key(f) == key)

    def storage_url(self) -> str:
        """The storage's URL: the config's, or the journal file in the run folder."""
        return self.storage or str(self.run_dir / "study.journal")

    def public_dump(self) -> dict[str, Any]:
        """The config as JSON with its storage URL's password masked: what the run folder and the
        studies keep (whoever resumes or joins the search names the storage again)."""
        return {**self.model_dump(mode="json"), "storage": self.storage and masked_url(self.storage)}


def resume_command(cfg: SearchConfig, workers: int = 1) -> str:
    """The `sparsetune search` command that continues `cfg.study`: `--resume` and every setting not
    at its default (the storage's password masked: the one thing to fill in)."""
    default = SearchConfig(kind=cfg.kind)
    args = ["sparsetune", "search", "--reuse" if cfg.kind == "reuse" else "--flow", ",".join(cfg.flows)]
    for name, value in cfg:
        if name in ("kind", "flows", "quick_floor") or value is None or value == getattr(default, name):
            continue  # quick_floor: no option sets it
        flag = "--" + name.replace("_", "-")
        if name == "tasks":
            args += [a for task in value for a in ("--task", task)]
        elif name == "params":
            args += [a for k, v in value.items() for a in ("--param", f"{k}={v}")]
        elif name == "save_defaults":
            args.append(flag)
        elif name == "confirm_defaults":  # on by default: only its off switch is written
            args.append("--no-confirm-defaults")
        else:
            args += [flag, masked_url(value) if name == "storage" else str(value)]
    return shlex.join(args + (["--workers", str(workers)] if workers > 1 else []) + ["--resume"])


@functools.lru_cache(maxsize=64)
def _shares_of_context(flows: tuple[str, ...]) -> bool:
    """Whether every flow's budget can be a share of the context (not a fixed window of tokens)."""
    from sparsetune.loader import flow_path, load_file

    return not any(_fixed_window(load_file(flow_path(f))) for f in flows)


def _fixed_window(cls: type) -> bool:
    """A decode flow whose budget is a fixed window of tokens (it takes no budget ratio)."""
    return "budget_ratio" in cls.inapplicable


def check_speed_context(cfg: SearchConfig, flow: str, cls: type) -> None:
    """A decode flow with a fixed window of tokens (no budget ratio) is refused where speed is taken
    at another context than accuracy: the two would describe different points."""
    speed_context = cfg.speed_shape()[3]
    if cfg.kind == "decode" and _fixed_window(cls) and speed_context != cfg.context:
        raise SparsetuneError(f"--flow {flow} attends a fixed window of tokens, not a share of the context: its "
                              f"accuracy at --context {cfg.context} and its speed at --speed-context {speed_context} "
                              f"would describe different points; search it with --speed-context {cfg.context}")


def check_search(cfg: SearchConfig) -> None:
    """Every check that needs neither torch nor weights: flows and their params, tasks, the model
    and its context, the speed model."""
    from sparsetune.evaluation.config import EvalConfig, check_config
    from sparsetune.models.resolve import model_config
    from sparsetune.flow.params import params_per_flow, unknown_param
    from sparsetune.loader import flow_kind, flow_path, load_file
    from sparsetune.tuning.space import dimensions

    _name, mcfg = model_config(cfg.model, False)
    option = "--flow" if cfg.kind == "decode" else "--reuse"
    per_flow = params_per_flow(cfg.params, [flow_key(f) for f in cfg.flows], "--param", option)
    for flow in cfg.flows:
        cls = load_file(flow_path(flow))
        if flow_kind(cls) != cfg.kind:
            other = "--reuse" if cfg.kind == "decode" else "--flow"
            raise SparsetuneError(f"{option} {flow}: a {flow_kind(cls)} flow; search it with {other} {flow}")
        if getattr(cls, "full_attention", False):
            raise SparsetuneError(f"--flow {flow}: full attention has nothing to search (dense is every search's baseline)")
        name = flow_key(flow)
        specs, fixed = cls.param_specs(), per_flow[name]
        for key in fixed:
            if key not in specs:
                raise unknown_param(name, key, specs, f"{name}:{key}" in cfg.params)
        cls.from_strings(fixed)  # what each trial's flow checks of them (values, ones it does not use), now
        check_speed_context(cfg, flow, cls)
        dims = dimensions(cls, mcfg.num_hidden_layers)
        if not dims:
            raise SparsetuneError(f"{option} {flow}: it has no param to search")
        if not any(d.name not in fixed for d in dims):
            raise SparsetuneError(f"{option} {flow}: every searched param is fixed by --param; nothing to search")
    if cfg.kind == "reuse":
        from sparsetune.evaluation.reuse_tasks import REUSE_TASKS

        plain = [t for t in cfg.tasks or () if not t.endswith(".jsonl") and t not in REUSE_TASKS]
        if plain:
            raise SparsetuneError(f"--task {plain[0]}: no reusable segments, so a reuse flow does nothing on it; use "
                                  f"{', '.join(REUSE_TASKS)} or a .jsonl file whose samples have segments")
    check_config(EvalConfig.of(model=cfg.model, tasks=cfg.tasks, context=cfg.context, samples=cfg.samples,
                               batch=cfg.batch, device=cfg.device, dtype=cfg.dtype))
    if cfg.speed_model is not None:
        model_config(cfg.speed_model, True)


def check_prompts(cfg: SearchConfig) -> None:
    """The check that needs the model's tokenizer: every task's prompt fits `--context` (else each
    trial would fail on it, one by one)."""
    from sparsetune.evaluation.tasks import DEFAULT_SUITE, build_samples
    from sparsetune.models.resolve import resolve_model

    tokenizer = resolve_model(cfg.model).load_tokenizer()
    if tokenizer is None:
        raise SparsetuneError(f"{cfg.model} has no tokenizer; a search measures accuracy on tasks, which need one")
    for task in cfg.tasks or DEFAULT_SUITE:
        build_samples(task, tokenizer, cfg.context, 1, cfg.seed)
