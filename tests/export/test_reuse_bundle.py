"""Reuse bundles (issue #44, item 1): a reuse flow's source and resolved params beside the decode flow
it runs with, checked like decode bundles; a reuse flow that is not a built-in as shipped is Python,
so it loads (to export, to check, to serve) only with the trust opt-in; and until a live SGLang has
served a reuse bundle, its launch refuses in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_clean_error, run
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import (MANIFEST, REUSE_SCHEMA, check_bundle, export_run, serving_problem,
                                      write_bundle)
from sparsetune.loader import build_flow, flow_path
from sparsetune.records import file_sha256
from sparsetune.reuse.base import ReuseFlow
from sparsetune.setup import Setup


def _edit(b: Path, **changes):
    m = json.loads((b / MANIFEST).read_text())
    for k, v in changes.items():
        m[k] = v(m) if callable(v) else v
    (b / MANIFEST).write_text(json.dumps(m))


def test_a_reuse_flow_exports_beside_the_decode_flow_it_runs_with(tmp_path):
    m = write_bundle(tmp_path / "cb", None, {}, reuse=(flow_path("cacheblend"), {"ratio": "0.2"}))
    assert m["schema"] == REUSE_SCHEMA and m["flow"] == "dense"  # no decode flow of its own: dense decode
    r = m["reuse"]
    assert (r["flow"], r["builtin"]) == ("cacheblend", True)
    assert r["params"] == {"ratio": "0.2", "check_layer": "1", "deviation": "v"}  # every param resolved
    assert (tmp_path / "cb" / r["source"]).read_bytes() == flow_path("cacheblend").read_bytes()
    assert check_bundle(tmp_path / "cb") == []
    # the bundle's copy builds the flow the engine would build from those params
    assert build_flow(str(tmp_path / "cb" / r["source"]), r["params"], ReuseFlow).params() == \
        build_flow("cacheblend", {"ratio": "0.2"}, ReuseFlow).params()
    # LoopServe brings its own decode flow, with the params it derives (under the user's), as `resolve` does
    m = write_bundle(tmp_path / "ls", None, {"interval": "4"}, reuse=(flow_path("loopserve"), {"budget": "512"}),
                     model="smollm2-135m")
    assert m["flow"] == "loopserve_decode" and (m["params"]["budget"], m["params"]["interval"]) == ("512", "4")
    setup = Setup.from_dict(m["setup"])
    assert setup.reuse.name == "loopserve" and setup.flow.name == "loopserve_decode"
    assert (setup.flow.origin["budget"], setup.flow.origin["interval"]) == ("reuse", "user")
    assert check_bundle(tmp_path / "ls") == []
    # a decode flow given: that one
    m = write_bundle(tmp_path / "q", flow_path("quest"), {"budget": "512"}, reuse=(flow_path("sparsex"), {}))
    assert (m["flow"], m["reuse"]["flow"], m["params"]["budget"]) == ("quest", "sparsex", "512")
    assert check_bundle(tmp_path / "q") == []


def test_bad_reuse_exports_are_one_line_each(tmp_path):
    with pytest.raises(SparsetuneError, match="--param needs --flow: reuse flow 'cacheblend' brings no decode flow"):
        write_bundle(tmp_path / "a", None, {"budget": "64"}, reuse=(flow_path("cacheblend"), {}))
    with pytest.raises(SparsetuneError, match="is not a reuse flow: --reuse takes a reuse flow"):
        write_bundle(tmp_path / "b", None, {}, reuse=(flow_path("quest"), {}))
    with pytest.raises(SparsetuneError, match="is not a decode flow: --flow takes a decode flow .*--reuse"):
        write_bundle(tmp_path / "c", flow_path("cacheblend"), {})
    with pytest.raises(SparsetuneError, match="has no parameter 'nosuch'"):
        write_bundle(tmp_path / "d", None, {}, reuse=(flow_path("cacheblend"), {"nosuch": "1"}))
    with pytest.raises(SparsetuneError, match="needs a decode flow .* or a reuse flow"):
        write_bundle(tmp_path / "e", None, {})
    assert not any((tmp_path / x).exists() for x in "abcde")


def test_check_names_each_problem_of_a_bad_reuse_bundle(tmp_path):
    def fresh(name):
        write_bundle(tmp_path / name, None, {}, reuse=(flow_path("cacheblend"), {}))
        return tmp_path / name

    b = fresh("src")
    (b / "cacheblend.py").write_text((b / "cacheblend.py").read_text() + "\n# edited\n")
    was = json.loads((b / MANIFEST).read_text())["reuse"]["source_sha256"]
    assert check_bundle(b) == [f"cacheblend.py changed since export (sha256 {file_sha256(b / 'cacheblend.py')[:12]}…, "
                               f"manifest {was[:12]}…); export again"]
    b = fresh("param")
    _edit(b, reuse=lambda m: {**m["reuse"], "params": {**m["reuse"]["params"], "ratio": "2"}})
    assert len(check_bundle(b)) == 1 and "ratio" in check_bundle(b)[0]
    b = fresh("unresolved")
    _edit(b, reuse=lambda m: {**m["reuse"], "params": {"ratio": "0.15"}})
    assert check_bundle(b) == ["reuse params not as resolved: check_layer=None (resolves to '1'), deviation=None (resolves to 'v')"]
    b = fresh("escape")
    _edit(b, reuse=lambda m: {**m["reuse"], "source": "../cacheblend.py"})
    assert check_bundle(b) == ["the reuse flow source '../cacheblend.py' is not in the bundle"]
    b = fresh("types")
    _edit(b, reuse=lambda m: {**m["reuse"], "params": {"ratio": 0.2}})
    assert check_bundle(b) == [f"{MANIFEST}: reuse.params must be an object of text values; export again"]
    b = fresh("schema")  # a reuse bundle read as a decode bundle would serve its decode flow without the reuse
    _edit(b, schema="sparsetune.bundle/1")
    assert check_bundle(b) == [f"{MANIFEST}: schema 'sparsetune.bundle/1' with a reuse flow; export again"]
    b = fresh("dropped")
    _edit(b, reuse=None)
    assert check_bundle(b) == [f"{MANIFEST}: schema '{REUSE_SCHEMA}' without a reuse flow; export again"]


MINE = '''
from sparsetune.flow import Param
from sparsetune.reuse import ReuseFlow


class Mine(ReuseFlow):
    name = {name!r}
    ratio = Param(0.1, low=0.0, high=1.0)
'''


def test_a_reuse_flow_that_is_not_a_built_in_runs_only_with_the_trust_opt_in(tmp_path, monkeypatch):
    """Written first (#44): a user's reuse flow is Python over the engine; exporting, checking and
    serving it would import it, so each needs the opt-in, and without it nothing of the file runs
    (the source check refuses a file that reaches past the flow modules in any case)."""
    import sparsetune.loader as loader

    monkeypatch.delenv("SPARSETUNE_TRUST_FLOW_CODE", raising=False)
    ran = []
    real = loader._import
    monkeypatch.setattr(loader, "_import", lambda path, *a: ran.append(Path(path).name) or real(path, *a))
    src = tmp_path / "mine.py"
    src.write_text(MINE.format(name="mine"))
    with pytest.raises(SparsetuneError, match="trust-flow-code"):
        write_bundle(tmp_path / "b", None, {}, reuse=(src, {}))
    assert ran == [] and not (tmp_path / "b").exists()
    m = write_bundle(tmp_path / "b", None, {}, reuse=(src, {}), trust=True)  # the user opts in
    assert m["reuse"]["builtin"] is False and m["reuse"]["params"] == {"ratio": "0.1"} and "mine.py" in ran
    ran.clear()
    problems = check_bundle(tmp_path / "b")  # another machine, no opt-in: named, and not run
    assert len(problems) == 1 and "trust-flow-code" in problems[0] and "mine.py" not in ran
    monkeypatch.setenv("SPARSETUNE_TRUST_FLOW_CODE", "1")
    assert check_bundle(tmp_path / "b") == [] and ran == ["mine.py"]
    # a name that is no identifier never becomes a file name
    evil = tmp_path / "evil.py"
    evil.write_text(MINE.format(name="../../escaped"))
    with pytest.raises(SparsetuneError, match="escaped"):
        write_bundle(tmp_path / "c", None, {}, reuse=(evil, {}), trust=True)
    assert not (tmp_path.parent / "escaped.py").exists() and not (tmp_path / "c").exists()
    with pytest.raises(SparsetuneError, match="import"):  # reaching past the flow modules: refused before anything runs
        (tmp_path / "os.py").write_text("import os\n" + MINE.format(name="osy"))
        write_bundle(tmp_path / "d", None, {}, reuse=(tmp_path / "os.py", {}), trust=True)


def test_a_reuse_searchs_point_exports_with_its_measured_figures(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    row = {"trial": "cacheblend#4", "flow": "cacheblend", "role": "search", "params": {"ratio": "0.07", "check_layer": "2"},
           "share": 0.31, "relative_accuracy": 0.97, "speedup": 2.9, "speed_kind": "modeled", "confirmed_accuracy": 0.96,
           "interval": [0.9, 1.0], "holds": True}
    (run_dir / "frontier.json").write_text(json.dumps({
        "kind": "reuse", "study": "r", "model": "smollm2-135m", "context": 512, "min_accuracy": 0.9,
        "speed_note": "modeled", "dense": {"accuracy": 0.5}, "confirmed_frontier": [row]}))
    (run_dir / "search.json").write_text(json.dumps({"search": {"tasks": ["rag"]}}))
    m = export_run(run_dir, tmp_path / "b")
    assert m["reuse"]["params"] == {"ratio": "0.07", "check_layer": "2", "deviation": "v"} and m["flow"] == "dense"
    measured = m["measured"]
    assert (measured["speedup"], measured["speedup_of"], measured["compute_share"]) == (2.9, "time to first token", 0.31)
    assert measured["accuracy"]["on"] == "smollm2-135m, rag at 512 tokens" and measured["accuracy"]["confirmed"] == 0.96
    assert m["measured_params"] == m["reuse"]["params"] and m["origin"]["trial"] == "cacheblend#4"
    assert Setup.from_dict(m["setup"]).reuse.user_params() == {"ratio": 0.07, "check_layer": 2}
    assert check_bundle(tmp_path / "b") == []


def test_a_reuse_bundle_is_served_unless_its_flow_narrows_the_mlp_and_its_launch_says_why_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    proc = run("export", "--reuse", "cacheblend", "--reuse-param", "ratio=0.2", "--out", str(tmp_path / "b"), "--json")
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["serving_problem"] is None and serving_problem(m) is None and "not served" not in proc.stderr
    served = json.loads((tmp_path / "b" / "sglang.json").read_text())
    assert served["server_args"] == {"attention_backend": "sparsetune", "page_size": 16, "cuda_graph_backend_prefill": "disabled",
                                     "chunked_prefill_size": -1}  # the backend, even for dense decode; prefills whole, eager
    assert served["reuse"]["served"] == "yes" and "sparsetune_parts" in served["reuse"]["client"]
    ok = run("export", "--check", str(tmp_path / "b"), "--json")  # the bundle itself checks
    assert ok.returncode == 0 and json.loads(ok.stdout)["problems"] == [] and "not served" not in ok.stderr
    # RedKnot narrows the MLP per row, which SGLang's model forward cannot: exported (the engine serves it), not launched
    red = run("export", "--reuse", "redknot", "--out", str(tmp_path / "r"), "--json")
    assert red.returncode == 0 and "narrows the MLP per row" in json.loads(red.stdout)["serving_problem"]
    assert "not served by SGLang:" in red.stderr and "launch_sglang.sh" in proc.stderr
    assert_clean_error(run("export", "--check", str(tmp_path / "r"), "--require-sglang"), "narrows the MLP per row")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}')
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    launch = subprocess.run(["bash", str(tmp_path / "r" / "launch_sglang.sh"), str(tmp_path / "m")],
                            capture_output=True, text=True, env=env)
    assert launch.returncode == 2 and "narrows the MLP per row" in launch.stderr and "Traceback" not in launch.stderr
    assert_clean_error(run("export", "--reuse", "quest", "--out", str(tmp_path / "x")), "is not a reuse flow")
    assert_clean_error(run("export", "--reuse-param", "ratio=0.2", "--flow", "quest", "--out", str(tmp_path / "y")),
                       "--reuse-param needs a reuse flow")
