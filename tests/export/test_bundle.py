"""Bundles: a search's confirmed point (or a flow and params alone) packed with its source, hash,
resolved parameters and figures; `check_bundle` names every way a bundle can go bad."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import SyntheticEvaluator
from sparsetune.errors import SparsetuneError
from sparsetune.export.bundle import (MANIFEST, SGLANG_CONFIG, check_bundle, export_run, flow_of, pick_point,
                                      read_bundle, write_bundle)
from sparsetune.flow.shapes import field_dims
from sparsetune.records import file_sha256
from sparsetune.loader import build_flow, flow_path
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.run import run_search


@pytest.fixture(scope="module")
def search_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cfg = SearchConfig(study="s", out=str(out), trials=10, context=2048, min_accuracy=0.9, confirm_samples=2)
    run_search(cfg, SyntheticEvaluator(cfg))
    return out / "s"


def test_a_search_exports_its_fastest_confirmed_point_above_the_bar_with_its_figures(search_run, tmp_path):
    summary = json.loads((search_run / "frontier.json").read_text())
    held = summary["confirmed_frontier"]
    assert held
    want = max((r for r in held if r["confirmed_accuracy"] >= 0.9), key=lambda r: r["speedup"])
    m = export_run(search_run, tmp_path / "b")
    assert m["origin"]["trial"] == want["trial"] and m["flow"] == want["flow"]
    assert m["measured"]["speedup"] == want["speedup"]
    assert m["measured"]["accuracy"]["confirmed"] == want["confirmed_accuracy"]
    assert m["measured"]["accuracy"]["interval_95"] == want["interval"]
    # the bundle runs exactly the trial's point: same flow parameters as the search built
    bundled = build_flow(str(tmp_path / "b" / m["source"]), m["params"]).params()
    assert bundled == build_flow(want["flow"], want["params"]).params()
    assert m["block_size"] == int(want["params"]["block_size"])
    assert (tmp_path / "b" / m["source"]).read_bytes() == flow_path(want["flow"]).read_bytes()
    assert check_bundle(tmp_path / "b") == [] and read_bundle(tmp_path / "b") == m


def test_trial_and_pick_choose_points_and_refuse_what_does_not_hold(search_run, tmp_path):
    held = json.loads((search_run / "frontier.json").read_text())["confirmed_frontier"]
    slowest = min(held, key=lambda r: r["speedup"])
    assert export_run(search_run, tmp_path / "a", trial=slowest["trial"])["origin"]["trial"] == slowest["trial"]
    most = max(held, key=lambda r: r["confirmed_accuracy"])
    assert pick_point(held, "max accuracy")["trial"] == most["trial"]
    assert pick_point(held, "min share where speedup > 0")["trial"] == min(held, key=lambda r: r["share"])["trial"]
    with pytest.raises(SparsetuneError, match="no confirmed point meets it"):
        pick_point(held, "max speedup where accuracy >= 2")
    with pytest.raises(SparsetuneError, match="write \"max|min"):
        pick_point(held, "fastest please")
    with pytest.raises(SparsetuneError, match="cannot read 'accuracy = 1'"):
        pick_point(held, "max speedup where accuracy = 1")
    with pytest.raises(SparsetuneError, match="not on the confirmed frontier of .*confirmed frontier: "):
        export_run(search_run, tmp_path / "c", trial="quest#999")
    with pytest.raises(SparsetuneError, match="no frontier.json"):
        export_run(tmp_path, tmp_path / "d")


def test_a_flow_and_params_alone_make_a_bundle_and_bad_params_are_refused(tmp_path):
    m = write_bundle(tmp_path / "q", flow_path("quest"), {"budget_ratio": "0.125", "block_size": "16"}, model="smollm2-135m")
    assert m["params"]["budget_ratio"] == "0.125" and m["block_size"] == 16 and m["measured"] is None
    assert m["params"]["dense_layers"] == ",".join(map(str, build_flow("quest").dense_layers))  # defaults resolved
    assert check_bundle(tmp_path / "q") == []
    with pytest.raises(SparsetuneError, match="exists"):
        write_bundle(tmp_path / "q", flow_path("quest"), {})
    assert "budget_ratio" not in write_bundle(tmp_path / "q", flow_path("quest"), {}, overwrite=True)["params"]  # the default: a token budget
    with pytest.raises(SparsetuneError, match="has no parameter 'nosuch'"):
        write_bundle(tmp_path / "x", flow_path("quest"), {"nosuch": "1"})
    with pytest.raises(SparsetuneError, match="reuse flow"):
        write_bundle(tmp_path / "y", flow_path("cacheblend"), {})


@pytest.mark.tuned_defaults
def test_a_flow_exported_for_a_model_takes_its_tuned_defaults_as_eval_does(tmp_path):
    """`export --flow F --model M` runs what `eval --flow F --model M` runs: M's tuned defaults under
    the user's --param (a shipped file here: smollm2-135m's quest block size), or the flow's own with
    --defaults published; the manifest says what it took."""
    from sparsetune.api import export
    from sparsetune.models.artifacts import read_tuned_defaults

    tuned = read_tuned_defaults("smollm2-135m")["quest"]["params"]
    assert tuned["block_size"] != "16"  # the published default, which the bundle must not fall back to
    m = export(out=tmp_path / "t", flow="quest", model="smollm2-135m")
    assert {k: m["params"][k] for k in tuned} == tuned and m["tuned"]["params"] == tuned
    assert json.loads((tmp_path / "t" / MANIFEST).read_text())["origin"]["tuned"]["params"] == tuned
    assert check_bundle(tmp_path / "t") == []
    m = export(out=tmp_path / "u", flow="quest", model="smollm2-135m", params={"block_size": "8"})
    assert m["params"]["block_size"] == "8" and "block_size" not in m["tuned"]["params"]  # the user's param wins
    m = export(out=tmp_path / "p", flow="quest", model="smollm2-135m", defaults="published")
    assert m["params"]["block_size"] == "16" and m["tuned"] is None
    assert export(out=tmp_path / "n", flow="quest")["params"]["block_size"] == "16"  # no model: nothing tuned
    m = export(out=tmp_path / "c", flow="quest", model="SmolLM2-135M")  # the model's name as eval records it
    assert m["model"] == "smollm2-135m" and m["tuned"]["params"] == tuned
    with pytest.raises(SparsetuneError, match="--defaults applies to --flow with --model"):
        export(out=tmp_path / "d", flow="quest", defaults="published")


def _edit(bundle, **changes):
    m = json.loads((bundle / MANIFEST).read_text())
    for k, v in changes.items():
        m[k] = v(m) if callable(v) else v
    (bundle / MANIFEST).write_text(json.dumps(m))


def test_check_names_each_problem_of_a_bad_bundle(tmp_path):
    def fresh(name):
        write_bundle(tmp_path / name, flow_path("block_topk"), {"block_size": "8"})
        return tmp_path / name

    b = fresh("src")
    (b / "block_topk.py").write_text((b / "block_topk.py").read_text() + "\n# edited\n")
    assert [p for p in check_bundle(b) if "changed since export" in p]
    b = fresh("param")
    _edit(b, params=lambda m: {**m["params"], "block_size": "3"})
    assert any("block_size" in p for p in check_bundle(b))
    b = fresh("unknown")
    _edit(b, params=lambda m: {**m["params"], "nosuch": "1"})
    assert check_bundle(b) == ["flow 'block_topk' has no parameter 'nosuch'; it has: " +
                               ", ".join(sorted(build_flow("block_topk").param_specs()))]
    b = fresh("blocks")
    _edit(b, block_size=16)
    assert check_bundle(b) == ["block_size 16 differs from the flow's '8'"]
    b = fresh("schema")
    _edit(b, schema="other/1")
    assert "expected 'sparsetune.bundle/1'" in check_bundle(b)[0]
    b = fresh("escape")
    _edit(b, source="../block_topk.py")
    assert check_bundle(b) == ["the flow source '../block_topk.py' is not in the bundle"]
    for key, value, needle in (("params", ["budget=8"], "params must be an object of text values"),
                               ("source", None, "source must be text"), ("graph", 3, "graph must be text")):
        b = fresh(f"type_{key}")
        _edit(b, **{key: value})
        assert len(check_bundle(b)) == 1 and needle in check_bundle(b)[0]
    b = fresh("graph")
    (b / "flow.graph.json").write_text((b / "flow.graph.json").read_text().replace('"max"', '"min"', 1))
    assert [p for p in check_bundle(b) if "flow.graph.json changed since export" in p]
    b = fresh("graph_op")  # a graph edited together with its hash: still only flow ops run
    g = json.loads((b / "flow.graph.json").read_text())
    g["graphs"][g["key"]]["64"]["index"]["nodes"][0]["op"] = "system"
    (b / "flow.graph.json").write_text(json.dumps(g))
    _edit(b, graph_sha256=file_sha256(b / "flow.graph.json"))
    assert "is not a flow op" in check_bundle(b)[0]
    b = fresh("kernel_param")  # block size and page size edited together: the graphs were traced at 8
    _edit(b, params=lambda m: {**m["params"], "block_size": "16"}, block_size=16)
    (b / "sglang.json").write_text(json.dumps({"server_args": {"page_size": 16}}))
    assert any("block_size=16 change what the flow computes" in p for p in check_bundle(b))
    (tmp_path / "empty").mkdir()
    assert "no bundle.json" in check_bundle(tmp_path / "empty")[0]
    with pytest.raises(SparsetuneError, match="does not check"):
        read_bundle(tmp_path / "empty")


def test_force_replaces_only_what_a_bundle_writes_and_an_unwritable_out_is_one_line(tmp_path):
    b = tmp_path / "b"
    write_bundle(b, flow_path("quest"), {"block_size": "8"})
    (b / "notes.txt").write_text("mine")
    write_bundle(b, flow_path("block_topk"), {"block_size": "4"}, overwrite=True)
    assert (b / "notes.txt").read_text() == "mine" and not (b / "quest.py").exists()
    assert json.loads((b / MANIFEST).read_text())["flow"] == "block_topk" and check_bundle(b) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(SparsetuneError, match="cannot write the bundle to .*pick a writable --out folder"):
        write_bundle(tmp_path / "file" / "b", flow_path("quest"), {})


def test_params_edited_after_the_search_measured_them_are_named(search_run, tmp_path):
    from sparsetune.export.bundle import edited_since_measured

    m = export_run(search_run, tmp_path / "b")
    assert edited_since_measured(m) == {}
    _edit(tmp_path / "b", params=lambda m: {**m["params"], "sink_blocks": "3"})
    assert check_bundle(tmp_path / "b") == []  # the same graphs serve it: it loads
    edited = edited_since_measured(json.loads((tmp_path / "b" / MANIFEST).read_text()))
    assert edited == {"sink_blocks": (m["params"]["sink_blocks"], "3")}
    from helpers import run

    said = run("export", "--check", str(tmp_path / "b"))
    assert said.returncode == 0 and "sink_blocks" in said.stderr and "no longer apply" in said.stderr, said.stderr


def test_the_cli_exports_checks_and_refuses_a_bundle_that_changed(search_run, tmp_path):
    from helpers import assert_clean_error, run

    proc = run("export", str(search_run), "--out", str(tmp_path / "b"), "--json")
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    assert m["bundle"] == str(tmp_path / "b") and "launch_sglang.sh" in proc.stderr
    served = json.loads((tmp_path / "b" / "sglang.json").read_text())
    assert served["server_args"] == {"attention_backend": "sparsetune", "page_size": m["block_size"]}
    launch = (tmp_path / "b" / "launch_sglang.sh").read_text()
    assert f"--attention-backend sparsetune --page-size {m['block_size']}" in launch and "SPARSETUNE_BUNDLE" in launch
    ok = run("export", "--check", str(tmp_path / "b"), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["problems"] == [], ok.stderr
    # here SGLang is not installed: a launch's check says so in one line
    assert_clean_error(run("export", "--check", str(tmp_path / "b"), "--require-sglang"), "SGLang is not installed")
    assert "(or 'sparsetune[sglang]';" in ok.stderr  # the hint as written (not eaten as console markup)
    source = tmp_path / "b" / m["source"]
    source.write_text(source.read_text() + "\n# edited\n")
    refused = run("export", "--check", str(tmp_path / "b"))
    assert_clean_error(refused, "changed since export")
    assert len([x for x in refused.stderr.splitlines() if x.strip()]) == 1, refused.stderr  # one line (#40)
    proc = run("export", "--flow", "quest", "--param", "block_size=8", "--param", "budget=512", "--out", str(tmp_path / "q"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "q" / "sglang.json").read_text())["server_args"]["page_size"] == 8


def test_sglang_versions_outside_the_supported_range_are_refused_by_name():
    from sparsetune.export.bundle import sglang_problem

    assert sglang_problem("0.5.16") is None and sglang_problem("0.5.13.post1") is None
    assert sglang_problem("0.5.23") is None and sglang_problem("0.5.23.post2") is None
    assert "SGLang 0.5.12 is not supported" in sglang_problem("0.5.12")
    refused = sglang_problem("0.5.20")  # between the ranges: untested
    assert "supported: 0.5.13 to 0.5.16, or 0.5.23" in refused and "pip install sglang==0.5.23" in refused
    assert "sglang==0.5.16 (torch 2.11)" in refused and "pip install sglang==0.5.23" in sglang_problem("0.5.24")
    assert "is not supported" in sglang_problem("garbage")


def test_the_launch_script_refuses_a_folder_sglang_cannot_load_and_a_missing_sglang(tmp_path):
    import os
    import subprocess
    import sys

    write_bundle(tmp_path / "b", flow_path("quest"), {"block_size": "16"})
    script = str(tmp_path / "b" / "launch_sglang.sh")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    usage = subprocess.run(["bash", script], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    (tmp_path / "weights").mkdir()
    no_model = subprocess.run(["bash", script, str(tmp_path / "weights")], capture_output=True, text=True, env=env)
    assert no_model.returncode == 2 and "has no config.json" in no_model.stderr
    (tmp_path / "weights" / "config.json").write_text('{"num_hidden_layers": 4}')
    unnamed = subprocess.run(["bash", script, str(tmp_path / "weights")], capture_output=True, text=True, env=env)
    assert unnamed.returncode == 2 and "names no architectures" in unnamed.stderr
    (tmp_path / "weights" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}')
    no_sglang = subprocess.run(["bash", script, str(tmp_path / "weights")], capture_output=True, text=True, env=env)
    assert no_sglang.returncode == 2 and "SGLang is not installed" in no_sglang.stderr  # stops before launching
    assert "architectures" not in no_sglang.stderr
    bare = tmp_path / "bare-python"  # an interpreter without sparsetune (no site packages)
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    alone = subprocess.run(["bash", script, str(tmp_path / "weights")], capture_output=True, text=True, cwd=tmp_path,
                           env={**{k: v for k, v in env.items() if k != "PYTHONPATH"}, "PYTHON": str(bare)})
    assert alone.returncode == 2 and alone.stderr.count("\n") == 1
    assert "sparsetune is not installed beside SGLang" in alone.stderr and "pip install sparsetune there" in alone.stderr


def test_check_model_names_what_keeps_sglang_from_serving_the_bundle_on_a_model(tmp_path):
    import json

    from sparsetune.export.bundle import check_model

    m = tmp_path / "m"
    assert check_model(tmp_path / "nowhere", {}) == [f"model folder {tmp_path / 'nowhere'} does not exist"]
    assert check_model("Qwen/Qwen3-8B", {}) == []  # a hub id: SGLang's to fetch
    m.mkdir()
    assert "has no config.json" in check_model(m, {})[0]
    (m / "config.json").write_text("{oops")
    assert "is not JSON" in check_model(m, {})[0]
    ok = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36}
    (m / "config.json").write_text(json.dumps(ok))
    assert check_model(m, {"dense_layers": "0,1", "select_layers": ""}) == []
    assert check_model(m, {"dense_layers": "0,40"}) == [
        f"dense_layers=0,40 names layer 40 but {m} has 36 layers; export again with layers of this model"]
    (m / "config.json").write_text(json.dumps({**ok, "architectures": None, "kv_lora_rank": 512}))
    problems = check_model(m, {})
    assert len(problems) == 2 and "names no architectures" in problems[0] and "MLA model" in problems[1]


def test_a_two_level_flow_exports_with_both_levels_graphs(tmp_path):
    """quest_2l's bundle keeps SGLang's page at 16 and holds the graphs of both levels (its page
    stages at the first level's params), so the host rebuilds it as a two-level flow from data."""
    write_bundle(tmp_path / "q", flow_path("quest_2l"), {"budget_ratio": "0.125"})
    manifest = json.loads((tmp_path / "q" / MANIFEST).read_text())
    assert manifest["params"]["block_size"] == "16" and manifest["params"]["coarse"] == "2.0"
    assert json.loads((tmp_path / "q" / SGLANG_CONFIG).read_text())["server_args"]["page_size"] == 16
    assert check_bundle(tmp_path / "q") == []
    flow = flow_of(tmp_path / "q", read_bundle(tmp_path / "q"))
    assert flow.uses_stage_graphs() and (flow.unit, flow.coarse) == (2, 2.0)
    page = flow.page_flow()
    assert page.level == "_page" and set(field_dims(page, 128)) == {"kmax", "kmin"}
    assert set(field_dims(flow, 128)) == {"centroid"}


def test_a_bundle_exported_with_one_level_refuses_coarse_set_later(tmp_path):
    """coarse is a runtime param, but a first level needs its own graphs: a manifest edited to set it
    is one line of `export --check`, not a failure inside SGLang at the first decode."""
    write_bundle(tmp_path / "q", flow_path("quest_2l"), {"coarse": "off"})
    path = tmp_path / "q" / MANIFEST
    m = json.loads(path.read_text())
    assert m["params"]["coarse"] == "off" and check_bundle(tmp_path / "q") == []
    m["params"]["coarse"] = "2.0"
    path.write_text(json.dumps(m))
    assert any("holds no graphs of its first level" in p for p in check_bundle(tmp_path / "q"))


def test_a_calibrated_flow_carries_its_models_calibration_and_checks_it(tmp_path, monkeypatch):
    """double_sparse_2l's bundle holds the channel order of the model it serves (the model's file for
    `calibration=auto`, or the file given), named by the flow's param and hashed; export refuses what
    cannot be resolved, and `check` names a changed or missing file or a model of other shapes."""
    from sparsetune.export.bundle import CALIBRATION, check_model
    from sparsetune.models.artifacts import synthetic_calibration, write_calibration

    monkeypatch.setenv("SPARSETUNE_MODELS", str(tmp_path / "models"))  # no calibration files there
    with pytest.raises(SparsetuneError, match="name the model"):
        write_bundle(tmp_path / "none", flow_path("double_sparse_2l"), {})
    with pytest.raises(SparsetuneError, match="run `sparsetune flows calibrate --model smollm2-135m`"):
        write_bundle(tmp_path / "none", flow_path("double_sparse_2l"), {}, model="smollm2-135m")
    assert not (tmp_path / "none").exists()
    wrong = write_calibration(tmp_path / "wrong.json", "other", synthetic_calibration(4, 3, 64), None, 8, "test")
    with pytest.raises(SparsetuneError, match="is for 4 layers x 3 KV heads x head_dim 64, smollm2-135m has 30"):
        write_bundle(tmp_path / "none", flow_path("double_sparse_2l"), {"calibration": str(wrong)}, model="smollm2-135m")
    # the model's own file, found by calibration=auto (`sparsetune flows calibrate` writes it there)
    from sparsetune.models.artifacts import artifact_path

    order = synthetic_calibration(30, 3, 64, seed=1)
    write_calibration(artifact_path("smollm2-135m"), "smollm2-135m", order, None, 8, "test")
    m = write_bundle(tmp_path / "b", flow_path("double_sparse_2l"), {"channels": "16"}, model="smollm2-135m")
    b = tmp_path / "b"
    assert m["params"]["calibration"] == CALIBRATION and m["calibration_shape"] == [30, 3, 64]
    assert json.loads((b / CALIBRATION).read_text())["channels"] == order
    assert check_bundle(b) == [] and flow_of(b, read_bundle(b)).channels == 16
    write_bundle(tmp_path / "c", flow_path("double_sparse_2l"), {}, model="SmolLM2-135M")  # the name it is filed under
    assert json.loads((tmp_path / "c" / CALIBRATION).read_text())["channels"] == order
    model = tmp_path / "served"
    model.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576}
    (model / "config.json").write_text(json.dumps(cfg))
    assert check_model(model, m["params"], (30, 3, 64)) == []
    (model / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 9}))
    assert check_model(model, m["params"], (30, 3, 64)) == [
        f"the bundle's {CALIBRATION} is for 30 layers x 3 KV heads x head_dim 64, {model} has 30 x 9 x 64; export "
        "again with this model's calibration"]
    # a file given by path; then tampered with, then gone
    given = write_calibration(tmp_path / "given.json", "smollm2-135m", synthetic_calibration(30, 3, 64, seed=2), None, 8, "t")
    write_bundle(b, flow_path("double_sparse_2l"), {"calibration": str(given)}, model="smollm2-135m", overwrite=True)
    assert (b / CALIBRATION).read_bytes() == given.read_bytes() and check_bundle(b) == []
    (b / CALIBRATION).write_text((b / CALIBRATION).read_text().replace("[", "[ ", 1))
    assert check_bundle(b) == [f"{CALIBRATION} changed since export; export again"]
    (b / CALIBRATION).unlink()
    assert "carries no calibration.json" in check_bundle(b)[0]
    # re-exported over itself from its own calibration.json (--force reads it before clearing the folder)
    write_bundle(b, flow_path("double_sparse_2l"), {"calibration": str(given)}, model="SmolLM2-135M", overwrite=True)
    write_bundle(b, flow_path("double_sparse_2l"), {"calibration": str(b / CALIBRATION)}, model="smollm2-135m",
                 overwrite=True)
    assert check_bundle(b) == [] and (b / CALIBRATION).read_bytes() == given.read_bytes()
    assert json.loads((b / MANIFEST).read_text())["setup"]["flow"]["params"]["calibration"] == CALIBRATION  # no local path
    # a flow without calibration writes none, and an overwrite removes an old one
    write_bundle(b, flow_path("quest"), {}, overwrite=True)
    assert not (b / CALIBRATION).exists() and check_bundle(b) == []
    m = json.loads((b / MANIFEST).read_text())  # a manifest claiming a calibration its flow does not take
    (b / MANIFEST).write_text(json.dumps({**m, "calibration_shape": 5}))
    assert check_bundle(b) == [f"{MANIFEST} names a calibration, but flow 'quest' is not calibrated; export again"]


def test_the_memory_note_says_what_the_fields_take_beside_sglangs_pool(tmp_path):
    """block_topk_2l at 2-token units in 16-token pages keeps a mean key (head_dim values) per unit and
    per page on its sparse layers (all but layer 0 of the embedded model's 30): (1/2 + 1/16) of a
    token's K and V (2 x head_dim) per KV head, on 29 of 30 layers."""
    m = write_bundle(tmp_path / "b", flow_path("block_topk_2l"), {"block_size": "16", "select_block": "2"}, model="smollm2-135m")
    share = (1 / 2 + 1 / 16) / 2 * 29 / 30
    assert abs(m["field_memory_share"] - share) < 1e-4
    note = json.loads((tmp_path / "b" / SGLANG_CONFIG).read_text())["memory"]
    assert f"s = {share:.0%}" in note and f"F' {0.116 + 0.684 / (1 + share):.2f}" in note
    m8 = write_bundle(tmp_path / "f", flow_path("block_topk_2l"), {"block_size": "16", "select_block": "2", "field_dtype": "fp8"},
                      model="smollm2-135m")
    assert abs(m8["field_memory_share"] - share / 2) < 1e-4  # 8-bit fields beside a bf16 pool: half the bytes
    assert write_bundle(tmp_path / "d", flow_path("dense"), {}, model="smollm2-135m")["field_memory_share"] == 0.0
    assert "keeps no fields" in json.loads((tmp_path / "d" / SGLANG_CONFIG).read_text())["memory"]
    write_bundle(tmp_path / "n", flow_path("quest"), {})  # no model: the rule, and how to have s computed
    assert "export with --model" in json.loads((tmp_path / "n" / SGLANG_CONFIG).read_text())["memory"]
