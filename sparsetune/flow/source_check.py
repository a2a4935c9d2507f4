"""Static checks of a flow file's source, run on its syntax tree BEFORE the file is imported.

Importing a Python file runs its module-level code, so `loader.load_file` (the one way every
flow is loaded: built-ins in `flows/` and user files for `--flow`, `--reuse`, `flows check`)
parses the file, runs these checks, and executes it only if they pass. The rules are allow-lists:

1. Top level: a docstring, imports, class and function definitions, constant assignments.
   Imports anywhere in the file come from `ALLOWED_MODULES` only (the flow API, the reuse helpers
   the built-ins use, `torch`, `math`, `typing`), and from sparsetune's own modules only names of
   the flow API (`_flow_api_name`: no module, no submodule such as the harness's, no private name;
   from the op module only ops). Code that runs while the file loads (module
   level, class bodies, decorators, base classes, default values, annotations) may call only
   `Param(...)`, `Search(...)` and the value builtins in `IMPORT_TIME_CALLS`.
2. Anywhere: builtins outside `SAFE_BUILTINS` (`exec`, `eval`, `compile`, `open`, `__import__`,
   `globals`, `locals`, `vars`, `breakpoint`, ... never); `getattr`/`setattr`/`delattr` only with
   a constant, non-dunder name; dunder names and attributes outside `ALLOWED_DUNDERS` (no
   `__class__`, `__globals__`, `__subclasses__`, `__builtins__`, ...); no attributes in
   `DENIED_ATTRS`, which reach modules (`.os`, `.sys`), frames (`.f_globals`) or code loaders
   (`torch.load`, `.hub`, `._C`); no special methods but `__init__`.
3. Decode flows (subclasses of `DecodeFlow`, seen from the class's bases, as imported names): the
   stages `cache` and `index`, and the helper methods they call through `self`, use flow ops
   (`F.*`) and a few value builtins only, and read none of the params the runtime applies
   (`RUNTIME_PARAMS`: budget, sink and local blocks, dense and select layers). Reuse flows (`ReuseFlow`) are plain torch; rules 1 and
   2 apply to them.

This is a pre-check that keeps honest mistakes and obvious abuse from running; it is NOT a
security sandbox (Python has many ways around any static check of its source). Flow code written
by an LLM agent is additionally to run in a subprocess sandbox.
"""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from pathlib import Path

from sparsetune.errors import SparsetuneError
from sparsetune.flow.base import RUNTIME_PARAMS

ALLOWED_MODULES = frozenset({
    "__future__", "math", "typing",
    "torch", "torch.nn.functional",
    "sparsetune.flow", "sparsetune.flow.ops", "sparsetune.flow.params", "sparsetune.flow.base",
    "sparsetune.reuse", "sparsetune.reuse.base", "sparsetune.reuse.head_classes", "sparsetune.models.artifacts",
})
_OPS_MODULE = "sparsetune.flow.ops"
_PARAM_MODULES = ("sparsetune.flow", "sparsetune.flow.params")

# Builtins a flow may use. The ones left out load code, open files or introspect the interpreter
# (exec, eval, compile, open, __import__, globals, locals, vars, breakpoint, input, help, dir, ...).
SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr", "classmethod",
    "complex", "dict", "divmod", "enumerate", "filter", "float", "format", "frozenset", "hasattr", "hash",
    "hex", "id", "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next",
    "object", "oct", "ord", "pow", "print", "property", "range", "repr", "reversed", "round", "set",
    "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple", "type", "zip",
    "Ellipsis", "NotImplemented",
} | {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)})
# Never, even when the file binds the name itself.
_FORBIDDEN_NAMES = frozenset({"exec", "eval", "compile", "open", "globals", "locals", "vars", "breakpoint"})
_ATTR_FUNCS = frozenset({"getattr", "setattr", "delattr"})  # only with a constant, non-dunder name
ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__qualname__", "__doc__", "__all__"})
DENIED_ATTRS = frozenset({
    # modules reachable as attributes of allowed ones (torch.os, a helper module's os, ...)
    "os", "sys", "subprocess", "builtins", "importlib", "shutil", "socket", "ctypes", "pickle", "marshal",
    "runpy", "inspect", "pathlib", "Path", "io", "tempfile", "multiprocessing", "threading", "signal", "gc",
    "code", "codeop", "pty", "posix", "nt", "system", "popen",
    # frames and code objects
    "f_globals", "f_locals", "f_builtins", "f_back", "f_code", "gi_frame", "gi_code", "cr_frame", "cr_code",
    "ag_frame", "ag_code", "tb_frame", "tb_next", "co_code", "func_globals", "func_code",
    # torch's code and pickle loaders, and its C internals
    "load", "load_library", "hub", "cpp_extension", "package", "from_file", "_C",
})
# What code that runs while the file loads may call, besides `Param(...)` and `Search(...)`.
IMPORT_TIME_CALLS = frozenset({
    "dict", "tuple", "list", "set", "frozenset", "range", "len", "float", "int", "str", "bool", "round",
    "min", "max", "abs", "sorted", "sum", "zip", "enumerate", "reversed",
})
_METHOD_DECORATORS = frozenset({"staticmethod", "classmethod", "property"})

# Decode-flow stages: what they may call, and their parameters.
VALUE_BUILTINS = frozenset({"dict", "len", "range", "tuple", "list", "float", "int", "round"})
# stage → its parameters (the page pair: a two-level flow's first level, `DecodeFlow.page_stages`)
STAGES = {"cache": "self, k, v", "index": "self, q, fields", "cache_page": "self, k, v", "index_page": "self, q, fields"}
DECODE_BASES = ("DecodeFlow", "TwoLevelFlow")  # the flow API's decode-flow classes a file may subclass
_STAGE_BANNED_NAMES = frozenset({"torch", "np", "numpy"})

_DUNDER = re.compile(r"^__\w+__$")


@dataclass(frozen=True)
class Problem:
    line: int
    message: str


def _is_dunder(name: str) -> bool:
    return bool(_DUNDER.match(name)) and name not in ALLOWED_DUNDERS


def _snippet(node: ast.AST, width: int = 60) -> str:
    text = ast.unparse(node).splitlines()[0] if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else node.name
    return text if len(text) <= width else text[: width - 3] + "..."


class FlowSource:
    """One parsed flow file and the names its imports bind."""

    def __init__(self, path: Path, tree: ast.Module) -> None:
        self.path = path
        self.tree = tree
        self.imports: dict[str, tuple[str, str | None]] = {}  # local name → (module, imported name or None)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = (a.name, None)
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = (top, None)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.imports[a.asname or a.name] = (node.module, a.name)

        self.defined = self._defined_names()

    def _defined_names(self) -> set[str]:
        """Names the file itself defines or assigns (so `Param`, `tuple`, `F` may not be the real ones)."""
        out: set[str] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
        return out

    @classmethod
    def parse(cls, path: Path, source: str | bytes | None = None) -> tuple[FlowSource | None, list[Problem]]:
        """The parsed file, or None and the problem (a syntax error, an unreadable file)."""
        try:
            text = path.read_bytes() if source is None else source
            return cls(path, ast.parse(text, filename=str(path))), []
        except SyntaxError as e:
            return None, [Problem(e.lineno or 1, f"syntax error: {e.msg}; fix the Python syntax")]
        except (OSError, ValueError) as e:
            return None, [Problem(1, f"cannot read the flow file ({e}); pass a Python source file")]

    @classmethod
    def of_text(cls, source: str | bytes) -> FlowSource | None:
        """A flow's source text parsed (None: it does not parse; `check_file` says why)."""
        return cls.parse(Path("flow.py"), source)[0]

    def declared_name(self) -> str | None:
        """The `name` the file's class declares, if it is a plain lowercase identifier (None otherwise)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                for st in node.body:
                    if (isinstance(st, ast.Assign) and [getattr(t, "id", None) for t in st.targets] == ["name"]
                            and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str)
                            and re.fullmatch(r"[a-z][a-z0-9_]{0,63}", st.value.value)):
                        return st.value.value
        return None

    # ---- what the imports bind ------------------------------------------------------------------

    def _resolves_to(self, name: str, module: str | tuple[str, ...], symbol: str | None) -> bool:
        got = self.imports.get(name)
        mods = (module,) if isinstance(module, str) else module
        return got is not None and got[0] in mods and got[1] == symbol

    def ops_names(self) -> set[str]:
        """Names bound to the flow ops module (`from sparsetune.flow import ops as F`); "F" if none."""
        names = {n for n in self.imports if self._resolves_to(n, "sparsetune.flow", "ops")
                 or self._resolves_to(n, _OPS_MODULE, None)}
        return (names or {"F"}) - self.defined

    def stage_banned_names(self) -> set[str]:
        """Names a stage may not use: torch/numpy, and whatever the file imports from torch."""
        return set(_STAGE_BANNED_NAMES) | {n for n, (m, _) in self.imports.items() if m.split(".")[0] == "torch"}

    def flow_kinds(self) -> dict[str, str]:
        """Top-level class name → "decode" or "reuse", from its bases (imported names or classes above it)."""
        kinds: dict[str, str] = {}
        for node in self.tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for b in node.bases:
                if isinstance(b, ast.Name) and b.id in kinds:  # a flow class defined above
                    kinds[node.name] = kinds[b.id]
                    break
                base = (self.imports.get(b.id, (None, None))[1] if isinstance(b, ast.Name)
                        else b.attr if isinstance(b, ast.Attribute) else None)
                if base in DECODE_BASES + ("ReuseFlow",):
                    kinds[node.name] = "decode" if base in DECODE_BASES else "reuse"
                    break
        return kinds

    def classes(self) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}

    # ---- the rules -------------------------------------------------------------------------------

    def problems(self) -> list[Problem]:
        """Every problem of the file, in line order."""
        found = self.top_level_problems() + self.anywhere_problems()
        kinds, classes = self.flow_kinds(), self.classes()
        for name, kind in kinds.items():
            if kind == "decode":
                found += self.stage_problems(classes[name])
        unique = list(dict.fromkeys(found))  # a problem once; on one line, in the order of the rules
        return sorted(unique, key=lambda p: p.line)

    def top_level_problems(self) -> list[Problem]:
        """Rule 1: what runs when the file loads."""
        out: list[Problem] = []
        for node in self.tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # the docstring (or another bare constant)
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass)):
                continue  # the modules are checked everywhere (anywhere_problems)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
                out += self._definition_problems(node)
                continue
            out.append(Problem(node.lineno, f"`{_snippet(node)}` runs when the flow file is loaded; the top level of a "
                                            "flow file may hold only a docstring, imports, classes, functions and "
                                            "constants (move this code into a method)"))
        return out

    def _definition_problems(self, node: ast.stmt) -> list[Problem]:
        """A def, class or assignment at module or class level: the parts that run at load time."""
        out: list[Problem] = []
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if not (isinstance(d, ast.Name) and d.id in _METHOD_DECORATORS):
                    out.append(Problem(d.lineno, f"decorator `@{_snippet(d)}` runs when the flow file is loaded; only "
                                                 "@staticmethod, @classmethod and @property are allowed"))
            a = node.args
            exprs = [*a.defaults, *(d for d in a.kw_defaults if d is not None), node.returns,
                     *(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x)]
            for e in exprs:
                if e is not None:
                    out += self._load_time_problems(e)
        elif isinstance(node, ast.ClassDef):
            for d in node.decorator_list:
                out.append(Problem(d.lineno, f"class decorator `@{_snippet(d)}` runs when the flow file is loaded; "
                                             "remove it"))
            for kw in node.keywords:
                out.append(Problem(node.lineno, f"class keyword `{kw.arg or '**'}=` runs code when the class is "
                                                "created; subclass DecodeFlow or ReuseFlow without keywords"))
            for b in node.bases:
                out += self._load_time_problems(b)
            for stmt in node.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) or isinstance(stmt, ast.Pass):
                    continue
                if isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
                    out += self._definition_problems(stmt)
                else:
                    out.append(Problem(stmt.lineno, f"`{_snippet(stmt)}` in the body of class {node.name} runs "
                                                    "when the flow file is loaded; a class body may hold only a "
                                                    "docstring, attributes (constants, Param(...)) and methods"))
        else:  # Assign / AnnAssign
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
                if not all(isinstance(x, ast.Name) for x in names):
                    out.append(Problem(node.lineno, f"assigning to `{_snippet(t)}` at module or class level is not "
                                                    "allowed; assign plain names only"))
            if isinstance(node, ast.AnnAssign):
                out += self._load_time_problems(node.annotation)
            if node.value is not None:
                out += self._load_time_problems(node.value)
        return out

    def _load_time_problems(self, expr: ast.expr) -> list[Problem]:
        """An expression evaluated when the file loads: constants, names, containers, comprehensions,
        and calls of `Param` or a value builtin only."""
        out: list[Problem] = []
        for node in ast.walk(expr):
            if isinstance(node, ast.Call):
                f = node.func
                ok = isinstance(f, ast.Name) and f.id not in self.defined and (
                    f.id in IMPORT_TIME_CALLS and f.id not in self.imports
                    or any(self._resolves_to(f.id, _PARAM_MODULES, n) for n in ("Param", "Search")))
                if not ok:
                    out.append(Problem(node.lineno, f"`{_snippet(node)}` would run when the flow file is loaded; at "
                                                    "module or class level call only Param(...), Search(...) or value "
                                                    "builtins (dict, tuple, range, ...); move other calls into a method"))
            elif isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
                out.append(Problem(node.lineno, f"`{_snippet(node)}` is not allowed at module or class level; "
                                                "write a method instead"))
        return out

    def anywhere_problems(self) -> list[Problem]:
        """Rule 2: imports, builtins, dunders and escape attributes, anywhere in the file."""
        out: list[Problem] = []
        bound = self._bound_names()
        allowed_attr_calls: set[int] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS:
                name = node.args[1] if len(node.args) >= 2 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and not _is_dunder(name.value):
                    allowed_attr_calls.add(id(node.func))
        mods = ", ".join(sorted(m for m in ALLOWED_MODULES if m != "__future__"))
        for node in ast.walk(self.tree):
            line = getattr(node, "lineno", 1)
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name not in ALLOWED_MODULES:
                        out.append(Problem(line, f"`import {a.name}` is not allowed in a flow file; import only "
                                                 f"from: {mods}"))
            elif isinstance(node, ast.ImportFrom):
                where = "." * node.level + (node.module or "")
                if node.level or node.module not in ALLOWED_MODULES:
                    out.append(Problem(line, f"`from {where} import ...` is not allowed in a flow file; import only "
                                             f"from: {mods}"))
                    continue
                for a in node.names:
                    if a.name == "*":
                        out.append(Problem(line, f"`from {where} import *` is not allowed; name what you import"))
                    elif a.name in DENIED_ATTRS or _is_dunder(a.name) or not _flow_api_name(node.module, a.name):
                        out.append(Problem(line, f"`from {where} import {a.name}` is not allowed in a flow file; "
                                                 "import the flow API only"))
            elif isinstance(node, ast.Name):
                n = node.id
                if _is_dunder(n):
                    out.append(Problem(line, f"`{n}` is not allowed in a flow file; special names reach the "
                                             "interpreter's internals"))
                elif n in _FORBIDDEN_NAMES:
                    out.append(Problem(line, f"`{n}` is not allowed in a flow file; a flow computes on its inputs "
                                             "(no code loading, file access or introspection)"))
                elif n in _ATTR_FUNCS and id(node) not in allowed_attr_calls:
                    out.append(Problem(line, f"`{n}` is allowed only as {n}(obj, \"name\", ...) with a constant, "
                                             "non-dunder name; write obj.name instead"))
                elif hasattr(builtins, n) and n not in SAFE_BUILTINS and n not in _ATTR_FUNCS and n not in bound:
                    out.append(Problem(line, f"the builtin `{n}` is not allowed in a flow file; a flow computes on its "
                                             "inputs (no code loading, file access, input or introspection)"))
            elif isinstance(node, ast.Attribute):
                if _is_dunder(node.attr):
                    out.append(Problem(line, f"`.{node.attr}` is not allowed in a flow file; special attributes reach "
                                             "the interpreter's internals, use public attributes"))
                elif node.attr in DENIED_ATTRS:
                    out.append(Problem(line, f"`.{node.attr}` is not allowed in a flow file (it reaches modules, "
                                             "frames or code loaders); compute with the flow API and tensors only"))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_dunder(node.value):
                out.append(Problem(line, f"the string {node.value!r} names a special attribute; it is not allowed in "
                                         "a flow file"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_dunder(node.name):
                out.append(Problem(line, f"defining `{node.name}` is not allowed in a flow file (special methods run "
                                         "implicitly); of the special methods only `__init__` may be defined"))
            elif isinstance(node, (ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith, ast.Await)):
                out.append(Problem(line, "async code is not allowed in a flow file; write plain functions"))
        return out

    def _bound_names(self) -> set[str]:
        """Every name the file binds somewhere (so a variable named like a builtin is not the builtin)."""
        out = set(self.imports)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.id)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                out.add(node.name)
        return out - _FORBIDDEN_NAMES

    def stage_problems(self, cls: ast.ClassDef) -> list[Problem]:
        """Rule 3 (decode flows): calls in the stages, and in the helper methods they call, that are
        not flow ops."""
        classes = self.classes()
        defs: dict[str, ast.FunctionDef] = {}
        chain, seen_cls = [cls], set()
        while chain:  # the class and its bases defined in this file (the class's own methods win)
            c = chain.pop(0)
            if c.name in seen_cls:
                continue
            seen_cls.add(c.name)
            for n in c.body:
                if isinstance(n, ast.FunctionDef):
                    defs.setdefault(n.name, n)
            chain += [classes[b.id] for b in c.bases if isinstance(b, ast.Name) and b.id in classes]
        methods = set(defs)
        ops, banned = self.ops_names(), self.stage_banned_names()
        reach, todo = [], [s for s in STAGES if s in defs]
        while todo:
            name = todo.pop(0)
            if name in reach or name == "__init__":
                continue
            reach.append(name)
            for node in ast.walk(defs[name]):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                        and node.func.attr in defs):
                    todo.append(node.func.attr)

        problems: list[Problem] = []
        for name in reach:
            fn = defs[name]
            args = [a.arg for a in fn.args.args]
            if fn.name in STAGES and not (len(args) == 3 or len(args) == 4 and args[3] == "const"):
                problems.append(Problem(fn.lineno, f"{fn.name}() takes ({STAGES[fn.name]}) plus, optionally, `const`; "
                                                   f"got ({', '.join(args)})"))
            for node in (n for stmt in fn.body for n in ast.walk(stmt)):
                line = getattr(node, "lineno", fn.lineno)
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    problems.append(Problem(line, "imports are not allowed inside a flow stage"))
                elif isinstance(node, ast.Name) and node.id in banned:
                    problems.append(Problem(line, f"`{node.id}` is not allowed in a flow stage; use flow ops (F.*)"))
                elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                      and node.attr in RUNTIME_PARAMS):
                    problems.append(Problem(line, f"a stage may not read self.{node.attr}: the runtime applies it "
                                                  "(budget rule, layer routing) and changes it without recompiling"))
                elif isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ops:
                        if f.attr not in _ops():
                            problems.append(Problem(line, f"unknown op {f.value.id}.{f.attr}; the op set is: "
                                                          f"{', '.join(sorted(_ops()))}"))
                    elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                        if f.attr not in methods:
                            problems.append(Problem(line, f"self.{f.attr}() is not a method of this flow"))
                    elif isinstance(f, ast.Name) and f.id in VALUE_BUILTINS:
                        pass
                    elif any(isinstance(x, ast.Name) and x.id in banned for x in ast.walk(f)):
                        pass  # reported once, as the banned name
                    else:
                        problems.append(Problem(line, f"`{ast.unparse(f)}(...)` is not a flow op; use F.* ops only"))
        return problems


_VALUE_TYPES = frozenset({"FT", "Fields", "Selection", "FlowError"})


def _flow_api_name(module: str, name: str) -> bool:
    """Whether `from module import name` takes a name of the flow API: from sparsetune's own
    modules a public name that is no module (the flow package's `ops` as F excepted: the harness,
    the engine and the search are modules, never the API), from the op module an op or a value
    type. Names of torch, math and typing are left to rules 2 and 3."""
    import importlib
    import importlib.util
    import types

    if not module.startswith("sparsetune"):
        return True
    if module == "sparsetune.flow" and name == "ops":
        return True
    if name.startswith("_"):
        return False
    mod = importlib.import_module(module)  # one of ALLOWED_MODULES: sparsetune's own
    if hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None:
        return False  # a submodule
    if isinstance(getattr(mod, name, None), types.ModuleType):
        return False
    if module == _OPS_MODULE:
        return name in _ops() or name in _VALUE_TYPES
    return True


def _ops() -> dict:
    from sparsetune.flow.ops import OPS

    return OPS


def format_problem(path: Path | str, p: Problem) -> str:
    return f"{path}:{p.line}: {p.message}"


MAX_BYTES = 1 << 20  # a flow is a short file; past this, no check (nor the interpreter) should chew on it


def file_problems(path: Path, source: str | bytes | None = None) -> list[str]:
    """Every problem of a flow file (`path:line: what is wrong; how to fix`), without importing it."""
    try:
        size = len(source) if source is not None else path.stat().st_size
        if size > MAX_BYTES:
            return [format_problem(path, Problem(1, f"the file is {size} bytes; a flow file is at most {MAX_BYTES}"))]
        parsed, problems = FlowSource.parse(path, source)
        if parsed is not None:
            problems = parsed.problems()
    except (RecursionError, MemoryError):
        problems = [Problem(1, "expressions nest too deeply to check; split them into named steps")]
    except OSError as e:
        problems = [Problem(1, f"cannot read the flow file ({e.strerror}); pass a readable Python source file")]
    return [format_problem(path, p) for p in problems]


def class_stage_problems(path: Path, class_name: str, source: str | bytes | None = None) -> list[str]:
    """Rule 3 for one class of a file (`flows check` of a loaded class; see `check.static_problems`)."""
    parsed, problems = FlowSource.parse(path, source)
    if parsed is not None:
        cls = parsed.classes().get(class_name)
        problems = parsed.stage_problems(cls) if cls is not None else []
    return [format_problem(path, p) for p in problems]


def check_file(path: Path, *, all_problems: bool = False, source: str | bytes | None = None) -> None:
    """Raise `SparsetuneError` if the flow file breaks a rule: one line with the first problem (and
    how many more), or with `all_problems`, every problem joined on one line (`flows check`)."""
    problems = file_problems(path, source)
    if not problems:
        return
    if all_problems and len(problems) > 1:
        raise SparsetuneError(f"{len(problems)} problems: " + " | ".join(problems))
    more = f" (and {len(problems) - 1} more; run sparsetune flows check {path})" if len(problems) > 1 else ""
    raise SparsetuneError(problems[0] + more)
