"""Find flows: built-ins in the repo's `flows/` directory, or a user file given by path.

A flow file is checked and executed once per content: classes are cached by (resolved path,
SHA-256 of the bytes), so switching flows or parameters in a long-lived process (an eval's passes,
a search worker's trials) reuses the class, and an edited file is loaded again."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple, TypeVar

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.params import Flow, is_flow_file

FlowT = TypeVar("FlowT", bound=Flow)


def flow_kind(cls: type) -> str:
    """"decode" (sparse attention while decoding) or "reuse" (KV reuse while prefilling)."""
    from sparsetune.reuse.flow import ReuseFlow

    return "reuse" if issubclass(cls, ReuseFlow) else "decode"


def flows_dir() -> Path:
    """`SPARSETUNE_FLOWS`, else the repo's `flows/` (editable install), else the installed copy."""
    env = os.environ.get("SPARSETUNE_FLOWS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1] / "flows"
    return repo if repo.is_dir() else Path(sys.prefix) / "share" / "sparsetune" / "flows"


def load_file(path: Path, *, all_problems: bool = False) -> type[Flow]:
    """Check a flow file's source (`source_check`: nothing of it runs before that passes), then
    import it and return the one flow class (`DecodeFlow` or `ReuseFlow` subclass) it defines.

    A failed check raises one line: the first problem and how many more, or with `all_problems`
    (`flows check`) every problem."""
    from sparsetune.flow.source_check import check_file
    from sparsetune.reuse.flow import ReuseFlow

    if not path.is_file():
        raise SparsetuneError(f"flow file {path} does not exist")
    try:
        source = path.read_bytes()
    except OSError as e:
        raise SparsetuneError(f"cannot read flow file {path}: {e.strerror}") from None
    key = (str(path.resolve()), hashlib.sha256(source).hexdigest())
    if key in _LOADED:
        return _LOADED[key]
    check_file(path, all_problems=all_problems, source=source)
    mod_name = f"sparsetune_flow_{path.stem}_{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise SparsetuneError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        # Run exactly the bytes that were checked (not a re-read of the file, which may have changed).
        exec(compile(source, str(path), "exec", dont_inherit=True), vars(module))
    except SyntaxError as e:
        raise SparsetuneError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - a user file can raise anything at import
        raise SparsetuneError(f"{path}: importing the flow failed: {type(e).__name__}: {e}") from None
    found = [
        obj for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, (DecodeFlow, ReuseFlow)) and obj.__module__ == mod_name
    ]
    if len(found) != 1:
        raise SparsetuneError(f"{path} must define exactly one DecodeFlow or ReuseFlow subclass, found {len(found)}")
    cls = found[0]
    if not cls.name:
        raise SparsetuneError(f"{path}: the flow class {cls.__name__} needs a `name`")
    cls.path = path  # type: ignore[attr-defined]
    _LOADED[key] = cls
    return cls


_LOADED: dict[tuple[str, str], type[Flow]] = {}  # (resolved path, sha256) → the flow class


def builtin_flows() -> dict[str, Path]:
    d = flows_dir()
    return {p.stem: p for p in sorted(d.glob("*.py")) if not p.name.startswith("_")} if d.is_dir() else {}


def flow_path(name_or_path: str) -> Path:
    """The file of a built-in flow name, or the given path of a flow file."""
    if is_flow_file(name_or_path):
        return Path(name_or_path)
    flows = builtin_flows()
    if name_or_path not in flows:
        near = difflib.get_close_matches(name_or_path, flows, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SparsetuneError(f"unknown flow {name_or_path!r}; {hint}built-in: {', '.join(flows)} "
                              "(or pass a path to a .py file)")
    return flows[name_or_path]


def get_flow_class(name_or_path: str, kind: type[FlowT] = DecodeFlow, *, all_problems: bool = False) -> type[FlowT]:
    """The flow class of a built-in name or a file path; it must be of `kind` (decode or reuse).
    `all_problems`: a file that fails the source check names every problem, not the first (`flows check`)."""
    cls = load_file(flow_path(name_or_path), all_problems=all_problems)
    if not issubclass(cls, kind):
        want, got = flow_kind(kind), flow_kind(cls)
        fix = "--reuse" if got == "reuse" else "--flow"
        raise SparsetuneError(f"{name_or_path!r} is a {got} flow, not a {want} flow; pass it with {fix} {name_or_path}")
    return cls


def build_flow(name_or_path: str, raw_params: dict[str, str] | None = None, kind: type[FlowT] = DecodeFlow) -> FlowT:
    return get_flow_class(name_or_path, kind).from_strings(raw_params or {})


class FlowChoice(NamedTuple):
    """A flow by name or path (None: none chosen) and its raw `--param` values."""

    name: str | None
    params: dict[str, str]


def resolve_decode_flow(flow: str | None, params: dict[str, str], reuse: str | None,
                        reuse_params: dict[str, str]) -> FlowChoice:
    """The decode flow to run: `flow` when given ("dense" included), else the reuse flow's own decode
    flow (LoopServe re-selects while decoding) with the parameters it derives, else None (dense)."""
    if flow is not None or reuse is None:
        return FlowChoice(flow, params)
    from sparsetune.reuse.flow import ReuseFlow

    rf = build_flow(reuse, reuse_params, ReuseFlow)
    return FlowChoice(rf.decode_flow, {**rf.decode_params(), **params}) if rf.decode_flow else FlowChoice(None, params)
