"""Find and load flows: built-ins by name, or a user file by path. The one place a flow file is loaded.

Who runs a flow file's Python (issue #40):
- **Trusted** files run in this process as before: the built-in flows *as shipped*, recognised by
  the SHA-256 of their bytes in the manifest written with the package (`data/builtin_flows.json`;
  not by their folder, which `SPARSETUNE_FLOWS` can point anywhere), and any file when the user
  opts in (`--trust-flow-code`, `SPARSETUNE_TRUST_FLOW_CODE=1`, after Hugging Face's
  `trust_remote_code`). Even then the static source check (`flow.source_check`) runs first.
- **Every other decode flow file is data**: a sandboxed child (`sparsetune.sandbox`: its own user,
  PID, mount and network namespaces, a scratch folder, limits) imports it and traces its stages into
  op graphs (`flow.graph`); this process reads the JSON back, validated, into a `GraphFlow` whose
  stages replay the graphs through the op set. Nothing of the file runs here, and graphs are cached
  by the file's hash and params (`~/.cache/sparsetune/flowgraphs`, 0700), so the child's ~3 s
  is paid once per file and param set.
- An untrusted **reuse** flow (plain Python over the executor) or a decode flow that does not trace
  is refused with the opt-in named. Agent candidates are never trusted in this process (`trust=False`).

Why tracing: the flow language already is an op graph (the kernel generator reads it), so the data
a child hands back is what the compiler and both executors consume; a second language for untrusted
code would have been a second copy of the op set. Classes are cached by (resolved path, SHA-256 of
the bytes): an edited file is loaded again.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import DecodeFlow
from sparsetune.flow.params import Flow, is_flow_file
from sparsetune.sandbox import TRUST_ENV

FlowT = TypeVar("FlowT", bound=Flow)
TRUST_HINT = f"if you trust its author, pass --trust-flow-code (or set {TRUST_ENV}=1)"
MANIFEST = Path(__file__).parent / "data" / "builtin_flows.json"


def flow_kind(cls: type) -> str:
    """"decode" (sparse attention while decoding) or "reuse" (KV reuse while prefilling)."""
    return "reuse" if issubclass(cls, _flow_bases()[1:] or ()) else "decode"


def _flow_bases() -> tuple[type, ...]:
    """(DecodeFlow, ReuseFlow if imported): a file can define a reuse flow only after importing it,
    so a decode flow's load (the tracing child's too) never pays for the reuse package's imports."""
    reuse = sys.modules.get("sparsetune.reuse.base")
    return (DecodeFlow,) + ((reuse.ReuseFlow,) if reuse is not None else ())


def flows_dir() -> Path:
    """`SPARSETUNE_FLOWS`, else the repo's `flows/` (editable install), else the installed copy."""
    env = os.environ.get("SPARSETUNE_FLOWS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1] / "flows"
    return repo if repo.is_dir() else Path(sys.prefix) / "share" / "sparsetune" / "flows"


def trust_opted_in() -> bool:
    """Whether the user opted in to running flow files' Python in this process."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


@functools.cache
def builtin_hashes() -> dict[str, str]:
    """SHA-256 → file name of every built-in flow as shipped (the manifest written with the package),
    read once per process: every flow load asks it."""
    try:
        return {v: k for k, v in json.loads(MANIFEST.read_text()).items()}
    except (OSError, ValueError):
        return {}


def write_manifest(folder: Path | None = None) -> dict[str, str]:
    """Write the built-in flows' manifest from `folder` (default: the repo's flows/): a release step
    (`python -m sparsetune.loader manifest`), checked by the test suite."""
    folder = folder or Path(__file__).resolve().parents[1] / "flows"
    data = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.py"))
            if not p.name.startswith("_")}
    MANIFEST.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    builtin_hashes.cache_clear()
    return data


def _trusted(path: Path, digest: str, trust: bool | None) -> bool:
    """A built-in as shipped; else `trust` when given; else inside the sandbox (whose child is the
    sandbox), or the user's opt-in unless the file is an agent's candidate."""
    from sparsetune.sandbox import inside

    if digest in builtin_hashes():
        return True
    if trust is not None:
        return trust
    return inside() or (trust_opted_in() and not is_candidate(path))


def is_candidate(path: Path) -> bool:
    """A flow an agent wrote (`agents.harness` keeps each beside its `candidate.json`): never trusted
    in this process, whatever the opt-in says."""
    return (path.parent / "candidate.json").is_file()


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise SparsetuneError(f"flow file {path} does not exist")
    try:
        return path.read_bytes()
    except OSError as e:
        raise SparsetuneError(f"cannot read flow file {path}: {e.strerror}") from None


def load_file(path: Path, *, all_problems: bool = False, trust: bool | None = None) -> type[Flow]:
    """The one flow class a flow file defines (module docstring: who runs it). `trust`: None follows
    the user's opt-in; False never runs the file here (agent candidates). A failed source check
    raises one line: the first problem and how many more, or with `all_problems` every problem."""
    from sparsetune.flow.source_check import check_file

    source = _read(path)
    digest = hashlib.sha256(source).hexdigest()
    trusted = _trusted(path, digest, trust)
    key = (str(path.resolve()), digest, trusted)
    if key in _LOADED:
        return _LOADED[key]
    check_file(path, all_problems=all_problems, source=source)
    cls = _import(path, source, digest) if trusted else _traced(path, source, digest)
    _LOADED[key] = cls
    return cls


def _import(path: Path, source: bytes, digest: str) -> type[Flow]:
    """Run a trusted file's checked bytes as a module; its one flow class."""
    from sparsetune.flow.values import check_name

    mod_name = f"sparsetune_flow_{digest[:24]}"
    spec = importlib.util.spec_from_loader(mod_name, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
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
        if isinstance(obj, type) and issubclass(obj, _flow_bases()) and obj.__module__ == mod_name
    ]
    if len(found) != 1:
        raise SparsetuneError(f"{path} must define exactly one DecodeFlow or ReuseFlow subclass, found {len(found)}")
    cls = found[0]
    if not cls.name:
        raise SparsetuneError(f"{path}: the flow class {cls.__name__} needs a `name`")
    check_name(cls.name)
    cls.path, cls.sha256 = path, digest  # type: ignore[attr-defined] - the file and the bytes it was loaded from
    return cls


_LOADED: dict[tuple[str, str, bool], type[Flow]] = {}  # (resolved path, sha256, trusted) → the flow class


# ---- untrusted decode flows: traced in a sandboxed child ---------------------------------------------

TRACE_WALL_S, TRACE_MEMORY_MB = 180.0, 3072


def graph_cache_dir() -> Path:
    """Where traced graphs are kept: a per-user folder, 0700 (`records.private_dir`)."""
    from sparsetune.records import cache_root, private_dir

    return private_dir(cache_root() / "flowgraphs")


def _traced(path: Path, source: bytes, digest: str) -> type[Flow]:
    """The `GraphFlow` of an untrusted file: its description at default params from the cache or
    the child; graphs of other params traced on demand (`GraphFlow.fetch`)."""
    from sparsetune.flow.graph import flow_class

    def fetch(params: dict[str, Any], head_dims: tuple[int, ...]) -> dict[str, Any]:
        return _describe(path, source, digest, params, head_dims)["graphs"]

    desc = _describe(path, source, digest, {})
    cls = flow_class(desc, fetch=fetch, origin=f"traced from {path}")
    cls.path, cls.sha256 = path, digest  # type: ignore[attr-defined]
    return cls


def _describe(path: Path, source: bytes, digest: str, params: dict[str, Any], head_dims: tuple[int, ...] = ()) -> dict[str, Any]:
    """`flow.graph.describe` of the file at `params` (and `head_dims` beside the usual ones), from the
    cache or a sandboxed child."""
    text, cached = trace_request(digest, params, head_dims)
    if cached.is_file():
        try:
            return json.loads(cached.read_text())
        except ValueError:
            cached.unlink(missing_ok=True)
    ans = run_child(path, source, text)
    cached.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(ans["describe"]))
    tmp.replace(cached)
    return ans["describe"]


def trace_request(digest: str, params: dict[str, Any], head_dims: tuple[int, ...] = ()) -> tuple[str, Path]:
    """What the tracing child is asked (params, head dimensions) as JSON, and where its answer is kept."""
    from sparsetune.flow.graph import HEAD_DIMS, _plain

    dims = sorted(set(HEAD_DIMS) | {int(d) for d in head_dims})
    text = json.dumps({"params": {k: _plain(v) for k, v in sorted(params.items())}, "head_dims": dims}, sort_keys=True)
    return text, graph_cache_dir() / digest / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


def run_child(path: Path, source: bytes, request: str) -> dict[str, Any]:
    """Import and trace the file in a sandboxed child; its answer, or one error line."""
    from sparsetune.sandbox import IsolationRefused, Limits, run_limited, scrub

    with tempfile.TemporaryDirectory(prefix="sparsetune-trace-") as tmp:
        scratch = Path(tmp)
        (scratch / "flow.py").write_bytes(source)
        (scratch / "request.json").write_text(request)
        result = scratch / "out.json"
        cmd = [sys.executable, "-m", "sparsetune.loader", "trace", str(scratch / "flow.py"), str(path),
               str(scratch / "request.json"), str(result)]
        try:
            out = run_limited(cmd, Limits(wall_s=TRACE_WALL_S, memory_mb=TRACE_MEMORY_MB, cpu_s=int(TRACE_WALL_S)),
                              scratch / "log.txt", result, scratch=scratch)
        except IsolationRefused as e:
            raise SparsetuneError(f"{path} is not a built-in flow, so it runs only in the sandbox, and {e.why}: "
                                  f"the sandbox cannot isolate it on this host; {TRUST_HINT}") from None
        ans = out.result
        if ans is None:
            raise SparsetuneError(f"{path}: tracing the flow in the sandbox failed: {out.reason()}")
    if not isinstance(ans, dict) or not ans.get("ok") or not isinstance(ans.get("describe"), dict):
        why = ans.get("reason") if isinstance(ans, dict) and ans.get("reason") else "the tracing child answered nothing usable"
        raise SparsetuneError(scrub(str(why)).replace("\n", " ")[:600])
    return ans


def _child(src: str, shown: str, request_file: str, out: str) -> int:
    """In the sandbox: import the file (trusted here: this process is the sandbox), trace it, write JSON."""
    import traceback

    from sparsetune.flow.graph import NotTraceable, describe
    from sparsetune.flow.values import FlowError

    def answer(data: dict[str, Any]) -> int:
        Path(out).write_text(json.dumps(data, default=str))
        return 0

    from sparsetune.sandbox import cap_address_space

    cap_address_space()
    shown_path = Path(shown)
    try:
        source = Path(src).read_bytes()
        from sparsetune.flow.source_check import check_file

        check_file(shown_path, source=source)
        cls = _import(shown_path, source, hashlib.sha256(source).hexdigest())
        if flow_kind(cls) == "reuse":
            return answer({"ok": False, "reason": f"{shown}: a reuse flow's Python runs in this process, so an untrusted "
                                                  f"one does not run; {TRUST_HINT}"})
        request = json.loads(Path(request_file).read_text())
        from sparsetune.flow.graph import _unplain

        params = {k: _unplain(v) for k, v in request["params"].items()}
        return answer({"ok": True, "describe": describe(cls, params, tuple(int(d) for d in request["head_dims"]))})
    except NotTraceable as e:
        return answer({"ok": False, "reason": f"{shown}: its stages do not trace into an op graph ({e}); {TRUST_HINT}"})
    except (SparsetuneError, FlowError) as e:  # their messages name the file and line
        return answer({"ok": False, "reason": str(e)})
    except Exception as e:  # noqa: BLE001 - whatever the file raises is its verdict, at its line
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == shown), None)
        return answer({"ok": False, "reason": f"{shown}:{line}: {type(e).__name__}: {e}" if line else
                       f"{shown}: {type(e).__name__}: {e}"})


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


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "trace":
        return _child(*argv[1:5])
    if argv == ["manifest"]:
        print(json.dumps(write_manifest(), indent=1))
        return 0
    print("usage: python -m sparsetune.loader trace SRC SHOWN REQUEST OUT | manifest", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
