"""A flow file is data until proven otherwise (issue #40).

Each hostile file below passes the static source check (`flow/source_check.py`) of 27cb96a and ran
code in the host there, through every command that takes a flow file or a bundle. Now an untrusted
decode file is imported only in the sandboxed child that traces it (`registry`, `flow/graph.py`);
the host replays op graphs. The marker each file would create must not appear, whatever runs it.
The traced flows must compute what the Python flows compute (the built-ins, compared op for op).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sparsetune import loader
from sparsetune.errors import SparsetuneError
from sparsetune.flow.graph import GraphFlow, NotTraceable, describe, flow_class
from sparsetune.flow.source_check import file_problems
from sparsetune.flow.shapes import dummy_inputs
from sparsetune.flow.values import Fields

REPO = Path(__file__).resolve().parents[2]

STAGES = '''
    def cache(self, k, v):
        return {"c": F.mean(k, dim=1)}

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["c"], q), dim=2))
'''

# Each: code that runs `touch MARKER` through a path the static check does not see.
HOSTILE = {
    # a call-back: `sorted` calls a function of the file while it loads
    "key_callback": '''
import torch
from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


def boom(x):
    getattr(getattr(torch, "os"), "system")("touch MARKER")
    return x


ORDER = sorted([2, 1], key=boom)


class Evil(DecodeFlow):
    name = "evil_key"
''' + STAGES,
    # a name the decorator check trusts, rebound by the file
    "rebound_decorator": '''
import torch
from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


def property(f):
    getattr(getattr(torch, "os"), "system")("touch MARKER")
    return f


class Evil(DecodeFlow):
    name = "evil_deco"

    @property
    def helper(self):
        return 1
''' + STAGES,
    # typing.get_type_hints as a key function evaluates a string annotation
    "type_hints": '''
import typing
from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


class Note:
    x: "__import__('os').system('touch MARKER')"


HINTS = sorted([Note], key=typing.get_type_hints)


class Evil(DecodeFlow):
    name = "evil_hints"
''' + STAGES,
    # code at instantiation
    "init_body": '''
import torch
from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


class Evil(DecodeFlow):
    name = "evil_init"

    def __init__(self, **values):
        getattr(getattr(torch, "os"), "system")("touch MARKER")
        super().__init__(**values)
''' + STAGES,
    # a property read inside a stage
    "stage_property": '''
import torch
from sparsetune.flow import DecodeFlow
from sparsetune.flow import ops as F


class Evil(DecodeFlow):
    name = "evil_prop"

    @property
    def alpha(self):
        getattr(getattr(torch, "os"), "system")("touch MARKER")
        return 1.0

    def cache(self, k, v):
        return {"c": F.scale(F.mean(k, dim=1), alpha=self.alpha)}

    def index(self, q, fields):
        return F.topk(F.max(F.gemm(fields["c"], q), dim=2))
''',
}


def hostile(tmp_path: Path, case: str) -> tuple[Path, Path]:
    marker = tmp_path / "MARKER"
    path = tmp_path / f"{case}.py"
    path.write_text(textwrap.dedent(HOSTILE[case]).replace("MARKER", str(marker)))
    return path, marker


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsetune.cli.main", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(autouse=True)
def _untrusted(monkeypatch):
    monkeypatch.delenv(loader.TRUST_ENV, raising=False)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_pass_the_static_check(tmp_path, case):
    """The premise: the static check alone lets each of these through (it is no sandbox)."""
    path, _ = hostile(tmp_path, case)
    assert file_problems(path) == []


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_runs_nothing_in_the_host_through_the_api(tmp_path, case):
    path, marker = hostile(tmp_path, case)
    cls = loader.load_file(path)
    assert issubclass(cls, GraphFlow)  # data: a flow over traced graphs
    flow = cls.from_strings({"block_size": "4"})
    x = dummy_inputs(flow, 64)
    fields = flow.run_cache(x.k, x.v, x.const)
    q, f = x.index({n: t.shape[1:] for n, t in fields.items()}, group=3)
    assert flow.run_index(q, f, x.const).score.shape == (5, 1, 1)
    assert not marker.exists()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_runs_nothing_through_the_commands(tmp_path, case):
    path, marker = hostile(tmp_path, case)
    check = cli("flows", "check", str(path), "--json")
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["ok"]
    show = cli("flows", "show", str(path), "--json")
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["code"] == path.read_text()  # the file shown, not run
    bundle = tmp_path / "bundle"
    export = cli("export", "--flow", str(path), "--param", "budget=64", "--out", str(bundle), "--json")
    assert export.returncode == 0, export.stderr
    checked = cli("export", "--check", str(bundle), "--json")
    assert checked.returncode == 0, checked.stderr
    assert not marker.exists()


def test_hostile_file_runs_nothing_through_generate(tmp_path):
    path, marker = hostile(tmp_path, "key_callback")
    proc = cli("generate", "--flow", str(path), "--param", "block_size=2", "--param", "budget=8", "--prompt", "hi",
               "--max-new-tokens", "2", "--device", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


def test_hostile_param_kind_is_refused(tmp_path):
    """`Param(kind=<a class of the file>)` ran that class on `--param`: a declaration's kind is now one
    of the plain types, checked in the child; the host never sees the class."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "kind.py"
    path.write_text(textwrap.dedent(f'''
        import torch
        from sparsetune.flow import DecodeFlow, Param
        from sparsetune.flow import ops as F


        class Boom(float):
            def __init__(self, text):
                getattr(getattr(torch, "os"), "system")("touch {marker}")


        class Evil(DecodeFlow):
            name = "evil_kind"
            alpha = Param(1.0, kind=Boom)
    ''') + textwrap.dedent(STAGES).replace("\n", "\n    ").rstrip() + "\n")
    with pytest.raises(SparsetuneError, match="kind must be one of"):
        loader.load_file(path).from_strings({"alpha": "2.0"})
    assert not marker.exists()


CALIBRATED = """
from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class Peek(DecodeFlow):
    name = "peek"
    calibrated = True
    calibration = Param({default!r}, choices={choices!r})
    channels = Param(16)

    def cache(self, k, v, const):
        return {{"centroid": F.gemm(F.mean(k, dim=1), const["channels"])}}

    def index(self, q, fields, const):
        return F.topk(F.max(F.gemm(fields["centroid"], F.gemm(q, const["channels"])), dim=2))
"""


@pytest.mark.parametrize("default, choices", [("/etc/shadow", None), ("auto", ("auto", "/root/.ssh/id_ed25519.json"))])
def test_a_flow_file_names_no_file_the_host_reads(tmp_path, default, choices):
    """A calibrated flow's `calibration` is a path the host opens: an untrusted file declaring one (as
    its default, or among the choices a search samples) had the host read /etc/shadow as a calibration
    (the parse failed, but the read ran). Only the user names such a file (`--param calibration=FILE`)."""
    path = tmp_path / "peek.py"
    path.write_text(CALIBRATED.format(default=default, choices=choices))
    with pytest.raises(SparsetuneError, match="'calibration'.*--param calibration=FILE"):
        loader.load_file(path)
    proc = cli("eval", "--flow", str(path), "--context", "1024", "--samples", "1", "--task", "niah_single",
               "--mode", "accuracy", "--device", "cpu")
    assert proc.returncode != 0 and "--param calibration=FILE" in proc.stderr and "Traceback" not in proc.stderr


def test_a_flow_file_calibrated_by_the_user_loads(tmp_path):
    path = tmp_path / "peek.py"
    path.write_text(CALIBRATED.format(default="auto", choices=None))
    flow = loader.load_file(path).from_strings({"calibration": str(tmp_path / "mine.json")})
    assert flow.calibration == str(tmp_path / "mine.json")  # the user's own, from the command line


def test_trusted_opt_in_imports_in_the_host(tmp_path, monkeypatch):
    path, marker = hostile(tmp_path, "init_body")
    monkeypatch.setenv(loader.TRUST_ENV, "1")
    cls = loader.load_file(path)
    assert not issubclass(cls, GraphFlow)
    cls.from_strings({})
    assert marker.exists()  # the user opted in: the file's own Python ran, here
    marker.unlink()
    assert issubclass(loader.load_file(path, trust=False), GraphFlow)  # agent candidates: never
    (tmp_path / "candidate.json").write_text("{}")  # a search's candidate folder: never, even opted in
    assert issubclass(loader.load_file(path), GraphFlow)


def test_untrusted_reuse_flow_is_refused_with_the_opt_in(tmp_path, monkeypatch):
    src = (REPO / "flows" / "epic.py").read_text().replace('name = "epic"', 'name = "my_epic"')
    path = tmp_path / "my_epic.py"
    path.write_text(src)
    with pytest.raises(SparsetuneError, match="--trust-flow-code"):
        loader.load_file(path)
    monkeypatch.setenv(loader.TRUST_ENV, "1")
    assert loader.flow_kind(loader.load_file(path)) == "reuse"


def test_shape_dependent_stage_is_not_traceable(tmp_path):
    path = tmp_path / "shapes.py"
    path.write_text(textwrap.dedent('''
        from sparsetune.flow import DecodeFlow
        from sparsetune.flow import ops as F


        class Shapes(DecodeFlow):
            name = "shapes"

            def cache(self, k, v):
                return {"c": F.mean(k, dim=1)}

            def index(self, q, fields):
                s = F.max(F.gemm(fields["c"], q), dim=2)
                if q.shape[1] > 2:
                    s = F.scale(s, alpha=2.0)
                return F.topk(s)
    '''))
    with pytest.raises(SparsetuneError, match="do not trace.*--trust-flow-code"):
        loader.load_file(path)


def test_builtin_manifest_matches_the_shipped_flows():
    """The built-ins run in-process because their bytes are in the manifest; an edited built-in is not
    trusted until `python -m sparsetune.loader manifest` is run again (a release step)."""
    shipped = {p.name: loader.hashlib.sha256(p.read_bytes()).hexdigest() for p in (REPO / "flows").glob("*.py")
               if not p.name.startswith("_")}
    assert json.loads(loader.MANIFEST.read_text()) == shipped


def test_a_builtin_copied_elsewhere_is_trusted_by_content_and_an_edit_is_not(tmp_path):
    copy = tmp_path / "quest.py"
    copy.write_bytes((REPO / "flows" / "quest.py").read_bytes())
    assert not issubclass(loader.load_file(copy), GraphFlow)
    copy.write_text(copy.read_text() + "\n# edited\n")
    assert issubclass(loader.load_file(copy), GraphFlow)


@pytest.mark.parametrize("name", ["quest", "block_topk", "h2o", "tidal", "double_sparse", "streaming",
                                  "loopserve_decode"])
def test_graph_flow_equals_the_python_flow(name):
    """Replayed graphs give bit-identical fields, scores and saved state to the flow's own Python,
    at other shapes than those traced (group 4, 9 blocks, 3 rows)."""
    cls = loader.get_flow_class(name)
    params = {"block_size": 4}
    desc = json.loads(json.dumps(describe(cls, params)))  # through JSON, as from the child
    a, b = cls.from_strings(params), flow_class(desc).from_strings(params)
    x = dummy_inputs(a, 64, rows=3)
    fa, fb = a.run_cache(x.k, x.v, x.const), b.run_cache(x.k, x.v, x.const)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[n].data, fb[n].data) for n in fa)
    q, ia = x.index({n: t.shape[1:] for n, t in fa.items()}, group=4, num_blocks=9)
    ib = Fields({n: dict.__getitem__(ia, n) for n in ia})
    sa, sb = a.run_index(q, ia, x.const), b.run_index(q, ib, x.const)
    assert (sa.score is None) == (sb.score is None)
    if sa.score is not None:
        assert torch.equal(sa.score.data, sb.score.data)
    assert ia.read == ib.read and ia.saved.keys() == ib.saved.keys()
    assert all(torch.equal(ia.saved[n].data, ib.saved[n].data) for n in ia.saved)


def test_tampered_graphs_are_refused():
    desc = describe(loader.get_flow_class("quest"), {})
    for bad in ({"op": "system", "args": ["touch x"], "kwargs": {}},
                {"op": "__import__", "args": ["os"], "kwargs": {}}):
        d = json.loads(json.dumps(desc))
        d["graphs"][d["key"]]["64"]["cache"]["nodes"].append(bad)
        with pytest.raises(NotTraceable, match="is not a flow op"):
            flow_class(d)
    d = json.loads(json.dumps(desc))
    d["graphs"][d["key"]]["64"]["cache"]["nodes"][0]["args"] = [{"call": "os.system"}]
    cls = flow_class(d)
    flow = cls.from_strings({})
    x = dummy_inputs(flow, 64)
    with pytest.raises(NotTraceable, match="is not a number, tuple or reference"):
        flow.run_cache(x.k, x.v, x.const)
    for field, value in (("name", 'x"""; import os'), ("name", "../../etc/evil")):
        d = json.loads(json.dumps(desc))
        d[field] = value
        with pytest.raises(SparsetuneError, match="not a Python identifier"):
            flow_class(d)
    d = json.loads(json.dumps(desc))
    d["params"]["block_size"]["kind"] = "os.system"
    with pytest.raises(NotTraceable, match="kind"):
        flow_class(d)
    for attr in ("level", "page_stages", "graphs", "fetch", "run_index"):  # a param may not replace the runtime's
        d = json.loads(json.dumps(desc))
        d["params"][attr] = dict(d["params"]["budget"])
        with pytest.raises(NotTraceable, match="would replace the runtime's attribute"):
            flow_class(d)
    two = describe(loader.get_flow_class("quest_2l"), {})  # a page pair without its partner
    page_key = next(k for k, g in two["graphs"].items() if "cache_page" in g["64"])
    del two["graphs"][page_key]["64"]["index_page"]
    with pytest.raises(NotTraceable, match="expected cache and index"):
        flow_class(two)


@pytest.mark.parametrize("name", ['x"""\nimport os\n"""', "../../escape", "a/b", ""])
def test_hostile_flow_names_are_refused_in_both_paths(tmp_path, monkeypatch, name):
    path = tmp_path / "named.py"
    path.write_text(textwrap.dedent(f'''
        from sparsetune.flow import DecodeFlow
        from sparsetune.flow import ops as F


        class Named(DecodeFlow):
            name = {name!r}
    ''') + textwrap.dedent(STAGES).replace("\n", "\n    ").rstrip() + "\n")
    with pytest.raises(SparsetuneError, match="identifier|needs a `name`"):
        loader.load_file(path)
    monkeypatch.setenv(loader.TRUST_ENV, "1")
    with pytest.raises(SparsetuneError, match="identifier|needs a `name`"):
        loader.load_file(path)


def test_generated_kernel_docstring_holds_any_text():
    from sparsetune.flow.compile.emit import kernel_source

    doc = 'indexer of flow \'x"""\nimport os; os.system("touch M")\n"""\''
    src = kernel_source("k", ["a"], ["pass"], doc)
    tree = compile(src, "k.py", "exec", dont_inherit=True)
    assert tree.co_consts[0] == doc  # one string literal: the docstring, whole
    assert "os.system" not in [c for c in tree.co_names]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_graph_cache_and_kernel_cache_are_private(tmp_path, monkeypatch):
    from sparsetune.records import private_dir

    d = private_dir(tmp_path / "a" / "cache")
    assert d.stat().st_mode & 0o777 == 0o700
    other = tmp_path / "theirs"
    other.mkdir()
    os.chown(other, 65534, 65534)  # another user's folder (the tests run as root in CI)
    with pytest.raises(SparsetuneError, match="another user's"):
        private_dir(other)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(SparsetuneError, match="a link"):
        private_dir(link)


def test_page_stages_that_assume_a_whole_page_trace(tmp_path):
    """A two-level flow's page stages run on whole pages only: they are traced at the first level's
    params (the unit the page), never on a unit's few tokens, so a stage shaped for the page traces
    and its graph flow replays both levels."""
    path = tmp_path / "paged.py"
    path.write_text(textwrap.dedent('''
        from sparsetune.flow import TwoLevelFlow
        from sparsetune.flow import ops as F


        class Paged(TwoLevelFlow):
            name = "paged"

            def cache_page(self, k, v):  # the page's 16 tokens as 4 rows of 4: a page's shape only
                return {"rows": F.max(F.reshape(k, 4, 4 * k.shape[2]), dim=1)}

            def index_page(self, q, fields):
                return F.topk(F.sum(fields["rows"], dim=2))  # [S, 1, 1]

            def cache(self, k, v):
                return {"centroid": F.mean(k, dim=1)}

            def index(self, q, fields):
                return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))
    '''))
    desc = describe(loader.load_file(path, trust=True), {})
    keys = [k for k, g in desc["graphs"].items() if "cache_page" in g["64"]]
    assert keys and all(json.loads(k)["select_block"] is None for k in keys)
    flow = flow_class(desc).from_strings({})
    x = dummy_inputs(flow.page_flow(), 64)
    assert set(flow.page_flow().run_cache(x.k, x.v, x.const)) == {"rows"}
