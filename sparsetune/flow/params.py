"""Declared, typed flow hyperparameters with defaults and search ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Collection, Self, Sequence

from sparsetune.errors import SparsetuneError


def is_flow_file(spec: str) -> bool:
    """A flow given as a file path (a .py file or a path), not a built-in name."""
    return spec.endswith(".py") or "/" in spec


@dataclass(frozen=True)
class Search:
    """How `sparsetune search` samples a `Param`, where its declared choices or range are not the
    space to search (`sparsetune.tuning.space`). `off`: never searched. `layers`: the param is a
    layer set, searched by its size N in [low, high] ("first": the first N layers; "spread": N
    layers spread evenly from the first sparse one, N = 0 meaning every sparse layer), or one layer
    ("index": a layer in [low, high], capped at the model's last). `share`: what a None default
    stands for, as a share of the model's layers (the flow's own rule; the search starts there)."""

    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    log: bool | None = None  # None: as the Param declares
    layers: str | None = None
    off: bool = False
    share: float | None = None


@dataclass(frozen=True)
class Param:
    """One hyperparameter. `choices` or `low`/`high` are the values it accepts, and the search space
    unless `search` says otherwise; `None` default = off. `optional`: None (off) is accepted beside a
    default that is on."""

    default: Any
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    kind: type | None = None  # inferred from the default when None
    doc: str = ""
    search: Search | None = None
    optional: bool = False

    @property
    def type(self) -> type:
        if self.kind is not None:
            return self.kind
        if self.default is None:
            return float
        return type(self.default)

    def parse(self, name: str, text: str) -> Any:
        """Parse a `--param name=text` value and validate it."""
        t = self.type
        try:
            if text.lower() in ("none", "off") and (self.default is None or self.optional):
                value = None
            elif t is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = text.lower() in ("true", "1")
            elif t is tuple:
                value = tuple(int(x) for x in text.split(",") if x.strip()) if text.strip() not in ("", "()") else ()
            else:
                value = t(text)
        except ValueError:
            raise SparsetuneError(f"--param {name}={text!r}: expected {t.__name__}") from None
        self.validate(name, value)
        return value

    def coerce(self, name: str, value: Any) -> Any:
        """A value from the Python API: a `--param` string is parsed; a typed value (0.125, 512,
        (0, 1), True) is checked against the parameter's type, then validated."""
        if isinstance(value, str):
            return self.parse(name, value)
        t = self.type
        ok = (value is None or (t is bool and isinstance(value, bool))
              or (t is int and isinstance(value, int) and not isinstance(value, bool))
              or (t is float and isinstance(value, (int, float)) and not isinstance(value, bool))
              or (t is tuple and isinstance(value, (list, tuple)) and all(isinstance(x, int) for x in value)))
        if not ok:
            raise SparsetuneError(f"--param {name}={value!r}: expected {t.__name__}")
        value = tuple(value) if t is tuple else float(value) if t is float and value is not None else value
        self.validate(name, value)
        return value

    def validate(self, name: str, value: Any) -> None:
        if value is None:
            if self.default is not None and not self.optional:
                raise SparsetuneError(f"--param {name}: a value is required")
            return
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every range test
            raise SparsetuneError(f"--param {name}={value!r}: must be a finite number" + self._space())
        if self.choices is not None and value not in self.choices:
            raise SparsetuneError(f"--param {name}={value!r}: must be one of {list(self.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.low is not None and value < self.low or self.high is not None and value > self.high:
                raise SparsetuneError(f"--param {name}={value!r}: must be in [{self.low}, {self.high}]")

    def _space(self) -> str:
        """" in [low, high]" where the param declares a range (the values a fix may take)."""
        return f" in [{self.low}, {self.high}]" if self.low is not None or self.high is not None else ""

    def describe(self) -> str:
        if self.choices is not None:
            space = "{" + ", ".join(map(str, self.choices)) + "}"
        elif self.low is not None or self.high is not None:
            space = f"[{self.low}, {self.high}]" + (" log" if self.log else "")
        else:
            space = ""
        return f"{self.type.__name__} = {self.default!r} {space}".strip()


def parse_param_args(args: list[str] | None, option: str = "--param") -> dict[str, str]:
    """`["budget=512", "block_size=16"]` → {"budget": "512", ...} (values parsed later per flow; a key
    may name its flow, `quest:budget`: `params_per_flow`)."""
    out: dict[str, str] = {}
    for a in args or []:
        k, sep, v = a.partition("=")
        if not sep or not k.strip():
            raise SparsetuneError(f"{option} {a!r}: write key=value, e.g. {option} budget=512")
        out[k.strip()] = v.strip()
    return out


class Flow:
    """A flow (decode or reuse): a `name`, the rule it implements, and `Param` class attributes
    that become validated instance attributes. `inapplicable` names inherited parameters that mean
    nothing to this flow, with the fix to tell a user (setting one is an error, not a silent no-op)."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = ""  # the published rule this flow implements
    inapplicable: ClassVar[dict[str, str]] = {}

    def __init__(self, **values: Any) -> None:
        params = self.param_specs()
        for key in values:
            if key not in params:
                raise SparsetuneError(
                    f"flow {self.name!r} has no parameter {key!r}; it has: {', '.join(sorted(params))}"
                )
        for key, spec in params.items():
            value = values.get(key, spec.default)
            spec.validate(key, value)
            setattr(self, key, value)

    @classmethod
    def param_specs(cls) -> dict[str, Param]:
        specs: dict[str, Param] = {}
        for klass in reversed(cls.__mro__):
            for k, v in vars(klass).items():
                if isinstance(v, Param):
                    specs[k] = v
        return specs

    @classmethod
    def from_strings(cls, raw: dict[str, Any]) -> Self:
        """From `--param` strings, or typed values from the Python API (`{"budget_ratio": 0.125}`)."""
        specs = cls.param_specs()
        values = {}
        for k, text in raw.items():
            if k not in specs:
                raise SparsetuneError(f"flow {cls.name!r} has no parameter {k!r}; it has: {', '.join(sorted(specs))}")
            if k in cls.inapplicable:
                raise SparsetuneError(f"flow {cls.name!r} does not use --param {k}: {cls.inapplicable[k]}")
            values[k] = specs[k].coerce(k, text)
        return cls(**values)

    def params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.param_specs()}


def unknown_param(flow: str, key: str, specs: Collection[str], own: bool) -> SparsetuneError:
    """The error for `--param [flow:]key` that `flow` does not declare, in a command over several flows
    (`own`: it was given as the flow's own; else it went to every flow)."""
    return SparsetuneError(f"--param {f'{flow}:' if own else ''}{key}: {flow} has no such param (it has {', '.join(specs)})"
                           + ("" if own else f"; a param for one flow only is --param FLOW:{key}=VALUE"))


def params_per_flow(params: dict[str, str], flows: Sequence[str], option: str = "--param", what: str = "--flow",
                    own_only: Collection[str] = ()) -> dict[str, dict[str, str]]:
    """Each of `flows`' params from one parsed `--param` list (`parse_param_args`): `key=value` for
    every flow (but those in `own_only`), then `flow:key=value` for that flow alone, over a shared
    value. Naming a flow that is not among `flows` is an error (`what`: the option that lists them)."""
    shared = {k: v for k, v in params.items() if ":" not in k}
    out = {f: ({} if f in own_only else dict(shared)) for f in flows}
    for k, v in params.items():
        flow, sep, key = k.partition(":")
        if not sep:
            continue
        flow = flow.strip()
        if flow not in out:
            raise SparsetuneError(f"{option} {flow}:...: {flow!r} is not one of {what} {','.join(flows)}")
        if not key.strip():
            raise SparsetuneError(f"{option} {k!r}: write flow:key=value, e.g. {option} {flow}:budget=512")
        out[flow][key.strip()] = v
    return out
