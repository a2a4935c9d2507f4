"""A run's setup as one value, and the one place it is resolved.

`Setup` holds what decides a run's attention: the engine's options (`EngineConfig`: the model, its
weights, the KV page size), the decode flow and the reuse flow with every param typed and where each
value came from, the executor and the defaults mode. `resolve` builds it from what a user asked for
(the CLI's options, the Python API's keywords, a search trial's point), once, at the API boundary,
with every check in one pass:

1. the engine options' rules and the model's existence (`EngineConfig.check`);
2. the reuse flow, its params, and the decode flow it brings (LoopServe re-selects while decoding);
3. the decode flow's params: the user's over the model's tuned defaults (`tuned_defaults`: a
   built-in flow on a model that has them, unless `defaults="published"`) over the flow's own;
4. one block size: `--block-size` and `--param block_size` are one setting (both given and
   different is an error); the KV page size is the flow's selection block;
5. the flow's layer params against the model's layers (`DecodeFlow.sparse_layers`).

`LLM` takes a `Setup`; eval's config.json, a search trial's record, a serve cell and an export
bundle store `Setup.to_dict()` and read it back with `Setup.from_dict`, so the point a search
found, the eval re-run of it and the bundle served are one value. Values are plain (JSON lists are
read back as tuples), so a setup compares equal to its round trip. Torch-free until `resolve`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from sparsetune.engine.config import DEFAULT_BLOCK_SIZE, ENGINE_FIELDS, EngineConfig
from sparsetune.errors import SparsetuneError

if TYPE_CHECKING:
    from sparsetune.flow.params import Flow

SCHEMA = "sparsetune.setup/1"
DEFAULTS = ("tuned", "published")  # the model's tuned flow defaults under the user's params, or the flow's own
EXECUTORS = (None, "reference", "compiled")  # None: compiled on CUDA, reference on CPU (`LLM`)
ORIGINS = ("published", "tuned", "reuse", "user")  # where a param's value came from (a search's point: "user")
BUDGET = ("budget", "budget_ratio")  # one setting: a user's either one replaces the tuned pair


def _plain(value: Any) -> Any:
    """A param value as the setup keeps it: JSON lists as tuples (so a round trip compares equal)."""
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class FlowSetup:
    """One flow of a run: `spec` as the user named it (a built-in name or a file), the flow's own
    `name`, every param's value, where each came from (`ORIGINS`), the file's SHA-256, and the tuned
    defaults it took (`{"flow", "params", "file", "source"}`; None: none)."""

    spec: str
    name: str
    params: dict[str, Any]
    origin: dict[str, str]
    source_sha256: str | None = None
    tuned: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", {k: _plain(v) for k, v in self.params.items()})

    @classmethod
    def of(cls, flow: Flow) -> FlowSetup:
        """The setup of a flow instance built elsewhere (a test's own, an agent's candidate)."""
        path = getattr(type(flow), "path", None)
        return cls(str(path) if path else flow.name, flow.name, flow.params(), {k: "user" for k in flow.params()},
                   getattr(type(flow), "sha256", None))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["params"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.params.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FlowSetup:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def user_params(self) -> dict[str, Any]:
        """The params the user (or a search's point) set: what a command line repeats."""
        return {k: v for k, v in self.params.items() if self.origin.get(k) == "user"}

    def build(self, kind: type | None = None) -> Flow:
        """The flow instance (its class found by `spec`; params checked again as the class declares
        them, so a setup read from a file is validated like a `--param`)."""
        cls = lookup_flow_class(self.spec, kind)
        specs = cls.param_specs()
        unknown = [k for k in self.params if k not in specs]
        if unknown:
            raise SparsetuneError(f"flow {cls.name!r} has no parameter {unknown[0]!r}; it has: {', '.join(sorted(specs))}")
        return cls(**{k: specs[k].coerce(k, v) for k, v in self.params.items()})


@dataclass(frozen=True)
class Setup:
    """A run's resolved setup (see the module docstring). `flow` None: dense attention; `reuse`
    None: segments run as plain text. `engine.block_size` is the KV page size, always set here."""

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(block_size=DEFAULT_BLOCK_SIZE))
    flow: FlowSetup | None = None
    reuse: FlowSetup | None = None
    executor: str | None = None
    defaults: str = "tuned"
    schema: str = SCHEMA

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def page_size(self) -> int:
        """Tokens per KV block (the engine's block size; SGLang's page size)."""
        return self.engine.block_size or DEFAULT_BLOCK_SIZE

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema, "engine": asdict(self.engine),
                "flow": None if self.flow is None else self.flow.to_dict(),
                "reuse": None if self.reuse is None else self.reuse.to_dict(),
                "executor": self.executor, "defaults": self.defaults}

    @classmethod
    def from_dict(cls, d: Any, what: str = "the setup") -> Setup:
        """A setup from `to_dict`'s object; one error naming `what` when it is not one."""
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise SparsetuneError(f"{what} is not a {SCHEMA} object (got {got!r})")
        try:
            return cls(engine=EngineConfig.from_dict(d["engine"]),
                       flow=None if d.get("flow") is None else FlowSetup.from_dict(d["flow"]),
                       reuse=None if d.get("reuse") is None else FlowSetup.from_dict(d["reuse"]),
                       executor=d.get("executor"), defaults=d.get("defaults", "tuned"))
        except (KeyError, TypeError, AttributeError) as e:
            raise SparsetuneError(f"{what} is incomplete or ill-typed ({e})") from None

    def with_flow(self, flow: str | None, params: dict[str, Any] | None = None, *, defaults: str | None = None) -> Setup:
        """This setup with another decode flow (None: dense), resolved afresh on its engine; the reuse
        flow is kept. A block size the params and the tuned defaults leave unset is this setup's page
        size where the flow can run on it (a two-level flow's page must hold more than one of its
        units; a flow may declare the pages it takes), else the flow's own; one they set is the new
        page size (a live engine lays its pool out again, `LLM.apply`)."""
        def again(params: dict[str, Any] | None) -> Setup:
            return resolve(replace(self.engine, block_size=None), flow=flow or "dense", params=params,
                           executor=self.executor, defaults=self.defaults if defaults is None else defaults)

        new = again(params)
        if (new.flow is not None and new.flow.origin["block_size"] == "published" and new.page_size != self.page_size
                and lookup_flow_class(new.flow.spec).from_strings(new.flow.params).runs_on_page(self.page_size)):
            new = again({**(params or {}), "block_size": self.page_size})  # unset: the pool's, as it is laid out
        return replace(new, reuse=self.reuse)

    def dense(self) -> Setup:
        """Full attention and no reuse flow, on this setup's pool (its page size kept)."""
        return replace(self, flow=None, reuse=None)


def describe_defaults(flow: str | None, model: str, tuned: dict[str, Any] | None) -> str | None:
    """One line on which defaults a run of `flow` used (`tuned`, as results record it) and where they
    came from (None: no flow)."""
    if flow is None or flow == "dense":
        return None
    if tuned is None:
        return f"{flow}: its published defaults (no tuned defaults for {model} under your --param)"
    src = tuned.get("source", {})
    where = src.get("study") and f"study {src['study']} ({src.get('trial', '?')})" or src.get("from", "")
    kept = ", ".join(f"{k}={v}" for k, v in tuned["params"].items())
    return (f"{flow}: tuned defaults for {model}: {kept} (from {tuned['file']}{'; ' + where if where else ''}); "
            f"--param overrides them, --defaults published ignores them")


# ---- resolution -----------------------------------------------------------------------------------

def resolve(engine: EngineConfig | None = None, *, flow: str | None = None, params: dict[str, Any] | None = None,
            reuse: str | None = None, reuse_params: dict[str, Any] | None = None, executor: str | None = None,
            defaults: str = "tuned") -> Setup:
    """The setup of a run (see the module docstring for the steps). `flow`: a built-in name or a
    flow file (None: dense, or the reuse flow's own decode flow; "dense": dense even then);
    `params`/`reuse_params`: `--param` strings or typed values; `engine.block_size` None: the flow's
    (else 16)."""
    engine = engine or EngineConfig()
    if defaults not in DEFAULTS:
        raise SparsetuneError(f"--defaults {defaults!r}: use tuned or published")
    if executor not in EXECUTORS:
        raise SparsetuneError(f"--flow-executor {executor!r}: use reference or compiled")
    model, mcfg = engine.check()
    params, reuse_params = dict(params or {}), dict(reuse_params or {})

    reuse_setup, reuse_flow = None, None
    if reuse is not None:
        from sparsetune.reuse.base import ReuseFlow

        reuse_setup, reuse_flow = _flow_setup(reuse, reuse_params, {}, {}, ReuseFlow)
    elif reuse_params:
        raise SparsetuneError("--reuse-param needs a reuse flow: add --reuse NAME")

    given = {k: "user" for k in params}  # the user's params, and where the others come from
    own = reuse_decode(reuse_flow, flow, params)
    reuses_decode = own is not None
    if reuses_decode:
        flow, params = own
        given = {k: given.get(k, "reuse") for k in params}
    elif flow is None and params:
        raise SparsetuneError("--param needs --flow")
    if engine.block_size is not None and flow is not None:  # --block-size is the flow's block_size
        if "block_size" in params and str(params["block_size"]) != str(engine.block_size):
            raise SparsetuneError(f"--block-size {engine.block_size} disagrees with --param block_size="
                                  f"{params['block_size']}; set it once")
        params["block_size"], given["block_size"] = engine.block_size, "user"

    flow_setup, decode = None, None
    if flow is not None:
        from sparsetune.flow.base import DecodeFlow

        tuned = None
        if defaults == "tuned" and not reuses_decode:  # a reuse flow's own decode flow keeps its params
            params, tuned = tuned_defaults(model, engine.random_weights, flow, params)
        flow_setup, decode = _flow_setup(flow, params, given, tuned or {}, DecodeFlow)
        if decode.full_attention:
            flow_setup, decode = None, None
        else:
            decode.sparse_layers(mcfg.num_hidden_layers)  # the layer params against the model's
            flow_setup = replace(flow_setup, tuned=tuned)
    page = decode.block_size if decode is not None else engine.block_size or DEFAULT_BLOCK_SIZE
    return Setup(replace(engine, block_size=page), flow_setup, reuse_setup, executor, defaults)


def reuse_decode(reuse_flow: Any, flow: str | None, params: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The reuse flow's own decode flow (LoopServe re-selects while decoding) and its params (those it
    derives, under the user's), where no decode flow is given; None: the given flow, or none."""
    if flow is not None or reuse_flow is None or not reuse_flow.decode_flow:
        return None
    return reuse_flow.decode_flow, {**reuse_flow.decode_params(), **params}


def _flow_setup(spec: str, raw: dict[str, Any], given: dict[str, str], tuned: dict[str, Any],
                kind: type) -> tuple[FlowSetup, Any]:
    """`spec` built with `raw` (the loader finds its class: trusted, traced or refused), as a
    `FlowSetup` with each param's origin, and the instance."""
    from sparsetune.loader import build_flow, builtin_hashes

    built = build_flow(spec, raw, kind)
    taken = set(tuned.get("params", {}))
    where = {k: given.get(k, "tuned" if k in taken else "user" if k in raw else "published") for k in built.params()}
    digest = type(built).sha256  # the bytes the loader loaded (not the file read again)
    if builtin_hashes().get(digest) == f"{built.name}.py":  # a built-in, wherever its copy lies (a bundle's)
        spec = built.name
    return FlowSetup(spec, built.name, built.params(), where, digest), built


def lookup_flow_class(spec: str, kind: type | None = None, *, all_problems: bool = False) -> type:
    """The flow class `spec` names (a built-in's name or a file; `loader.get_flow_class`: trusted,
    traced in the sandbox, or refused), of `kind` (default: a decode flow; `Flow`: either kind):
    the one lookup every layer above uses (listing, checking, search spaces, serve cells)."""
    from sparsetune.flow.base import DecodeFlow
    from sparsetune.loader import get_flow_class

    return get_flow_class(spec, kind or DecodeFlow, all_problems=all_problems)


def tuned_defaults(model: str, random_weights: bool, flow: str, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`params` over the model's tuned defaults for `flow` (a built-in flow's name; a flow file keeps
    its own; `models.artifacts.read_tuned_defaults`: shipped from measured tables, or saved by
    `sparsetune search --save-defaults`), and what was taken ({"flow", "params", "file", "source"};
    None: nothing). `budget` and `budget_ratio` are one setting: the user's either one replaces both."""
    from sparsetune.flow.params import is_flow_file

    if flow == "dense" or is_flow_file(flow):
        return dict(params), None
    from sparsetune.models.artifacts import read_tuned_defaults

    entry = read_tuned_defaults(model, random_weights).get(flow)
    if entry is None:
        return dict(params), None
    user = set(params)
    if user & set(BUDGET):
        user |= set(BUDGET)
    taken = {k: v for k, v in entry["params"].items() if k not in user}
    if not taken:
        return dict(params), None
    return {**taken, **params}, {"flow": flow, "params": taken, "file": entry["file"], "source": entry["source"]}


FLOW_OPTIONS = ("flow", "params", "reuse", "reuse_params", "executor", "defaults")


def resolve_options(engine: EngineConfig | None = None, **options: Any) -> Setup:
    """`resolve` from flat keyword options, as the Python API takes them: `FLOW_OPTIONS` and any
    `EngineConfig` field (over `engine` when given); an unknown one is a TypeError."""
    flows = {k: options.pop(k) for k in FLOW_OPTIONS if k in options}
    unknown = [k for k in options if k not in ENGINE_FIELDS]
    if unknown:
        raise TypeError(f"unknown option {unknown[0]!r}")
    return resolve(replace(engine or EngineConfig(), **options), **flows)


def _setup_from_json(value: Any) -> Any:
    return Setup.from_dict(value) if isinstance(value, dict) else value


def _setup_to_json(value: Setup) -> dict[str, Any]:
    return value.to_dict()


def setup_field():
    """A `Setup` as a field of a pydantic config (eval's): written as `to_dict`'s object, read back
    with `from_dict` (pydantic is imported only by the configs that hold one)."""
    from typing import Annotated

    from pydantic import BeforeValidator, PlainSerializer

    return Annotated[Setup, BeforeValidator(_setup_from_json), PlainSerializer(_setup_to_json)]
