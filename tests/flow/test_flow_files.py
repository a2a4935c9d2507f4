"""Flow files are checked on their source before anything of them runs (issue #12).

`flows check`, `generate --flow` and `eval --flow` all load a flow file through
`loader.load_file`, which parses the file, checks it (`flow/source_check.py`) and only then
imports it. A file that breaks a rule is one clean `error: path:line: ...` line, exit code 2, and
none of its code has run. The CLI cases go through the real entry point.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune import loader
from sparsetune.loader import builtin_flows, get_flow_class, load_file
from sparsetune.flow.source_check import file_problems

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsetune.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def assert_refused(proc: subprocess.CompletedProcess, path: Path, line: int, *needles: str) -> str:
    """Exit code 2, no traceback, and the last stderr line is the error naming the file and line."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines and lines[-1].startswith("error:"), proc.stderr
    assert f"{path}:{line}:" in lines[-1], lines[-1]
    for n in needles:
        assert n in lines[-1], lines[-1]
    return lines[-1]


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def evil_file(tmp_path: Path) -> tuple[Path, Path]:
    """A flow file that would create MARKER at import (a valid flow class otherwise)."""
    marker = tmp_path / "MARKER"
    path = write(tmp_path / "evil.py", f'''
        import os

        from sparsetune.flow import DecodeFlow

        os.system("touch {marker}")


        class Evil(DecodeFlow):
            name = "evil"
            full_attention = True
    ''')
    return path, marker


VALID_DECODE = '''
    from sparsetune.flow import DecodeFlow, Param
    from sparsetune.flow import ops as F


    class Good(DecodeFlow):
        name = "good"
        source = "test"
        temperature = Param(1.0, low=0.01, high=10.0, log=True, doc="softmax temperature")

        def cache(self, k, v):
            return {"centroid": F.mean(k, dim=1)}

        def index(self, q, fields):
            return F.topk(F.max(self.scores(q, fields), dim=2))

        def scores(self, q, fields):
            return F.softmax(F.gemm(fields["centroid"], q), dim=0, scale=1.0 / self.temperature)
'''


# ---- through the CLI ------------------------------------------------------------------------------

def test_flows_check_does_not_run_module_level_code(tmp_path):
    path, marker = evil_file(tmp_path)
    assert_refused(cli("flows", "check", str(path)), path, 1, "`import os` is not allowed")
    assert not marker.exists()


def test_generate_does_not_run_a_refused_flow_file(tmp_path):
    path, marker = evil_file(tmp_path)
    assert_refused(cli("generate", "--flow", str(path), "--prompt", "hi", "--max-new-tokens", "2"), path, 1)
    assert not marker.exists()


def test_eval_does_not_run_a_refused_flow_file(tmp_path):
    path, marker = evil_file(tmp_path)
    out = tmp_path / "runs"
    proc = cli("eval", "--flow", str(path), "--task", "niah_single", "--samples", "1", "--context", "256",
               "--out", str(out))
    assert_refused(proc, path, 1)
    assert not marker.exists()
    assert not out.exists() or not any(out.iterdir())  # no run directory


def test_generate_torch_in_a_decode_stage_is_one_line(tmp_path):
    """Was a TypeError traceback from inside the runtime."""
    path = write(tmp_path / "torchy.py", '''
        import torch

        from sparsetune.flow import DecodeFlow
        from sparsetune.flow import ops as F


        class Torchy(DecodeFlow):
            name = "torchy"

            def cache(self, k, v):
                return {"c": F.mean(k, dim=1)}

            def index(self, q, fields):
                return torch.topk(F.gemm(fields["c"], q), 2)
    ''')
    assert_refused(cli("generate", "--flow", str(path), "--prompt", "hi", "--max-new-tokens", "2"), path, 14,
                   "`torch` is not allowed in a flow stage")


@pytest.mark.parametrize("case", ["open", "print", "dunder"])
def test_flows_check_refuses(tmp_path, case):
    marker = tmp_path / "MARKER"
    head = "from sparsetune.flow import DecodeFlow\nfrom sparsetune.flow import ops as F\n"
    body = {
        "open": (f'open("{marker}", "w")\n', 3, "runs when the flow file is loaded"),
        "print": ('print("x")\n', 3, "runs when the flow file is loaded"),
        "dunder": ("", 12, "`.__subclasses__` is not allowed"),
    }[case]
    path = tmp_path / f"{case}.py"
    path.write_text(head + body[0] + textwrap.dedent('''

        class Flow(DecodeFlow):
            name = "flow"

            def cache(self, k, v):
                return {"c": F.mean(k, dim=1)}

            def index(self, q, fields):
                classes = ().__class__.__subclasses__()
                return F.topk(F.max(F.gemm(fields["c"], q), dim=2))
    ''' if case == "dunder" else '''

        class Flow(DecodeFlow):
            name = "flow"
            full_attention = True
    '''))
    assert_refused(cli("flows", "check", str(path)), path, body[1], body[2])
    assert not marker.exists()


def test_flows_new_template_passes_check(tmp_path):
    path = tmp_path / "myflow.py"
    assert cli("flows", "new", "myflow", "--out", str(path)).returncode == 0
    assert file_problems(path) == []
    proc = cli("flows", "check", str(path))
    assert proc.returncode == 0, proc.stderr


# ---- the check itself -----------------------------------------------------------------------------

BUILTIN_FILES = sorted((REPO / "flows").glob("*.py")) + sorted((REPO / "benchmarks" / "flows").glob("*.py"))


@pytest.mark.parametrize("path", BUILTIN_FILES, ids=lambda p: p.name)
def test_builtin_flows_pass_the_source_check(path):
    assert file_problems(path) == []
    assert load_file(path).name


def test_every_builtin_is_covered():
    assert {p.stem for p in BUILTIN_FILES} >= set(builtin_flows()) | {"exact_topk"}


def test_check_runs_before_import(tmp_path, monkeypatch):
    """The source problem is reported, not the import error: the file never ran."""
    path = write(tmp_path / "raises.py", '''
        import subprocess

        raise RuntimeError("the file ran")
    ''')
    with pytest.raises(SparsetuneError) as e:
        load_file(path)
    assert f"{path}:1: `import subprocess` is not allowed" in str(e.value)
    assert "RuntimeError" not in str(e.value) and "the file ran" not in str(e.value)

    def no_import(*a, **k):
        raise AssertionError("imported before the check")

    monkeypatch.setattr(loader.importlib.util, "module_from_spec", no_import)
    with pytest.raises(SparsetuneError, match="is not allowed"):
        load_file(path)


def test_a_clean_file_that_fails_at_import_still_says_so(tmp_path):
    path = write(tmp_path / "zero.py", '''
        from sparsetune.flow import DecodeFlow


        class Zero(DecodeFlow):
            name = "zero"
            full_attention = 1 / 0
    ''')
    with pytest.raises(SparsetuneError, match="importing the flow failed: ZeroDivisionError"):
        load_file(path)


def test_first_problem_then_count_and_check_flow_lists_all(tmp_path):
    from sparsetune.flow.check import check_flow

    path = write(tmp_path / "many.py", '''
        import os
        import sys

        from sparsetune.flow import DecodeFlow

        os.getcwd()


        class Many(DecodeFlow):
            name = "many"
            full_attention = True
    ''')
    with pytest.raises(SparsetuneError) as e:
        load_file(path)
    one = str(e.value)
    assert "\n" not in one and one.startswith(f"{path}:1: `import os`")
    assert one.endswith(f"(and 2 more; run sparsetune flows check {path})"), one
    with pytest.raises(SparsetuneError) as e:
        check_flow(get_flow_class(str(path), all_problems=True))
    every = str(e.value)
    assert "\n" not in every and every.startswith("3 problems: ")
    for where in (f"{path}:1:", f"{path}:2:", f"{path}:6:"):
        assert where in every, every


def test_decode_helper_called_by_a_stage_uses_ops_only(tmp_path):
    path = write(tmp_path / "helper.py", VALID_DECODE.replace(
        'F.softmax(F.gemm(fields["centroid"], q), dim=0, scale=1.0 / self.temperature)', "q.softmax(0)"))
    assert file_problems(path) == [f"{path}:17: `q.softmax(...)` is not a flow op; use F.* ops only"]
    good = write(tmp_path / "good.py", VALID_DECODE)
    assert file_problems(good) == []
    from sparsetune.flow.check import static_problems

    assert static_problems(load_file(good)) == []  # the public per-class form of the same rule


def test_a_two_level_flows_page_stages_are_held_to_the_stage_rules(tmp_path):
    """A `TwoLevelFlow` is a decode flow to the source check: its page stages (and the helpers they
    call) use flow ops only, take the stage parameters, and a page stage alone is refused at load."""
    quest_2l = (Path(__file__).parents[2] / "flows" / "quest_2l.py").read_text()
    assert file_problems(write(tmp_path / "ok.py", quest_2l)) == []
    bad = write(tmp_path / "bad.py", quest_2l.replace('F.max(upper, dim=2)', 'upper.amax(2)'))
    assert file_problems(bad) == [f"{bad}:26: `upper.amax(...)` is not a flow op; use F.* ops only"]
    args = write(tmp_path / "args.py", quest_2l.replace("def index_page(self, q, fields):", "def index_page(self, q):"))
    assert any("index_page() takes (self, q, fields)" in x for x in file_problems(args))
    alone = write(tmp_path / "alone.py", quest_2l.replace("def cache_page(self, k, v):", "def cache_pages(self, k, v):"))
    with pytest.raises(Exception, match="index_page alone: a first level needs both cache_page and index_page"):
        load_file(alone, trust=True)
    # a subclass may override one page stage and inherit the other
    base = load_file(write(tmp_path / "base.py", quest_2l), trust=True)

    class Quest2LMean(base):
        name = "quest_2l_mean"

        def index_page(self, q, fields):
            return base.index(self, q, fields)

    assert Quest2LMean.page_stages and Quest2LMean.page_level().index is Quest2LMean.index_page


def test_reuse_flow_methods_are_plain_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSETUNE_TRUST_FLOW_CODE", "1")  # a reuse flow file runs only opted in (issue #40)
    path = write(tmp_path / "myreuse.py", '''
        """A reuse flow: its hooks compute on the executor's tensors with torch."""
        import math

        import torch

        from sparsetune.flow import Param
        from sparsetune.reuse import ReuseFlow


        class MyReuse(ReuseFlow):
            name = "myreuse"
            k = Param(4, low=0, high=64, doc="tokens")

            def initial_rows(self, layout):
                rows = torch.zeros(layout.num_tokens, dtype=torch.bool)
                rows[: min(self.k, math.ceil(layout.num_tokens / 2))] = True
                return rows
    ''')
    assert file_problems(path) == []
    assert load_file(path).name == "myreuse"


HEAD = "from sparsetune.flow import DecodeFlow, Param\nfrom sparsetune.flow import ops as F\nfrom sparsetune.reuse import ReuseFlow\n\n\n"


@pytest.mark.parametrize("code,needle", [
    ("import importlib", "`import importlib` is not allowed"),
    ("from os import system", "`from os import ...` is not allowed"),
    ("import torch.utils.cpp_extension", "`import torch.utils.cpp_extension` is not allowed"),
    ("from torch import load", "`from torch import load` is not allowed"),
    ("from . import x", "`from . import ...` is not allowed"),
    ("from torch import *", "`from torch import *` is not allowed"),
    # From sparsetune's own modules, the flow API only: not the harness, the engine or the op module's internals.
    ("from sparsetune.flow import check", "`from sparsetune.flow import check` is not allowed"),
    ("from sparsetune.flow.ops import active", "`from sparsetune.flow.ops import active` is not allowed"),
    ("from sparsetune.flow.ops import torch", "`from sparsetune.flow.ops import torch` is not allowed"),
    ("from sparsetune.reuse.base import F", "`from sparsetune.reuse.base import F` is not allowed"),
    ("from sparsetune.flow.ops import _where", "`from sparsetune.flow.ops import _where` is not allowed"),
    ("from sparsetune.flow.ops import gemm, FT", None),
    ("from sparsetune.reuse.base import attention_mass", None),
    ("X = __import__('os')", "`__import__` is not allowed"),
    ("X = (1, 2)\nY = len(X)", None),  # constants are fine
    ("for i in range(3):\n    pass", "runs when the flow file is loaded"),
    ("if True:\n    X = 1", "runs when the flow file is loaded"),
    ("class R(ReuseFlow):\n    name = 'r'\n    k = Param(1)\n    t = make()", "would run when the flow file is loaded"),
    ("class R(ReuseFlow, metaclass=type):\n    name = 'r'", "class keyword `metaclass=`"),
    ("class R(ReuseFlow):\n    name = 'r'\n    def __init_subclass__(cls):\n        pass",
     "defining `__init_subclass__`"),
    ("def f(x=print('x')):\n    pass", "would run when the flow file is loaded"),
    ("@print\ndef f():\n    pass", "decorator `@print`"),
    ("def f(x):\n    return eval(x)", "`eval` is not allowed"),
    ("def f(x):\n    return exec(x)", "`exec` is not allowed"),
    ("def f(x):\n    return compile(x, 'f', 'exec')", "`compile` is not allowed"),
    ("def f():\n    return globals()", "`globals` is not allowed"),
    ("def f():\n    return vars()", "`vars` is not allowed"),
    ("def f(x):\n    return getattr(x, '__globals__')", "`getattr` is allowed only as"),
    ("def f(x, n):\n    return getattr(x, n)", "`getattr` is allowed only as"),
    ("def f(x):\n    return getattr(x, 'shape', None)", None),
    ("def f(x):\n    setattr(x, '__class__', int)", "`setattr` is allowed only as"),
    ("def f(g):\n    return g.__globals__", "`.__globals__` is not allowed"),
    ("def f(g):\n    return g.__code__", "`.__code__` is not allowed"),
    ("def f():\n    return __builtins__", "`__builtins__` is not allowed"),
    ("def f(g):\n    return g.gi_frame.f_back.f_globals", "`.f_globals` is not allowed"),
    ("import torch\ndef f(p):\n    return torch.load(p)", "`.load` is not allowed"),
    ("def f():\n    return dir()", "the builtin `dir` is not allowed"),
    # The runtime applies these (a retune changes them without recompiling): no stage reads them.
    ("class D(DecodeFlow):\n    name = 'd'\n    def index(self, q, fields):\n        return F.topk(q * self.budget)",
     "a stage may not read self.budget"),
    ("class D(DecodeFlow):\n    name = 'd'\n    def index(self, q, fields):\n        return self.s(q)\n"
     "    def s(self, q):\n        return F.topk(q * self.sink_blocks)", "a stage may not read self.sink_blocks"),
    ("class D(DecodeFlow):\n    name = 'd'\n    def index(self, q, fields):\n        return F.topk(q * self.block_size)",
     None),
])
def test_source_rules(tmp_path, code, needle):
    path = tmp_path / "flow.py"
    path.write_text(HEAD + code + "\n")
    problems = file_problems(path)
    if needle is None:
        assert problems == []
    else:
        assert any(needle in p for p in problems), problems
        assert all(p.startswith(f"{path}:") for p in problems)


def test_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path / "broken.py", "from sparsetune.flow import DecodeFlow\n\nclass (:\n")
    with pytest.raises(SparsetuneError, match=rf"{path}:3: syntax error"):
        load_file(path)


def test_a_flow_file_is_loaded_once_per_content(tmp_path, monkeypatch):
    """Classes are cached by (path, content hash): the same bytes are not checked or run again; an
    edited file is."""
    body = '''
        from sparsetune.flow import DecodeFlow, Param
        from sparsetune.flow import ops as F


        class Mine(DecodeFlow):
            name = "mine"
            budget = Param(64, low=1)

            def cache(self, k, v):
                return {"kmax": F.max(k, dim=1)}

            def index(self, q, fields):
                return F.topk(F.max(F.gemm(fields["kmax"], q), dim=2))
    '''
    path = write(tmp_path / "mine.py", body)
    first = load_file(path)
    runs = []
    monkeypatch.setattr("sparsetune.flow.source_check.check_file", lambda *a, **k: runs.append(a))
    assert load_file(path) is first and get_flow_class(str(path)) is first and not runs
    write(tmp_path / "mine.py", body.replace("64", "32"))
    edited = load_file(path)
    assert edited is not first and edited.from_strings({}).params()["budget"] == 32
