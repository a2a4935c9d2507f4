"""A run's setup is one value (`sparsetune.setup`): the CLI, the Python API, a search trial's record,
an eval's config.json and an export bundle give the same one, and it is resolved in one module."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from sparsetune.engine.config import EngineConfig
from sparsetune.errors import SparsetuneError
from sparsetune.setup import FlowSetup, Setup, resolve

PACKAGE = Path(__file__).resolve().parents[1] / "sparsetune"
MODEL = "smollm2-135m"
POINT = {"budget": "64", "block_size": "8", "sink_blocks": "2"}


def _cli_setup(*args: str) -> Setup:
    """What the CLI resolves for `--flow quest --param ...` (cli/options → api)."""
    from sparsetune.api import resolve_options
    from sparsetune.cli.options import setup_options

    return resolve_options(**setup_options(MODEL, flow="quest", param=list(args), defaults="published"))


def test_the_cli_the_api_and_a_search_trial_resolve_one_value(tmp_path):
    from sparsetune.evaluation.config import load_resume_config
    from sparsetune.tuning.config import SearchConfig
    from sparsetune.tuning.trial import EngineEvaluator

    cli = _cli_setup(*(f"{k}={v}" for k, v in POINT.items()))
    api = resolve(EngineConfig(model=MODEL), flow="quest", params={"budget": 64, "block_size": 8, "sink_blocks": 2},
                  defaults="published")
    trial = EngineEvaluator(SearchConfig(study="s", out=str(tmp_path), model=MODEL)).eval_config(
        "quest", POINT, samples=2, seed=0)
    run = tmp_path / "run"
    run.mkdir()  # the trial's record, as its run folder keeps it, read back
    (run / "config.json").write_text(json.dumps({"eval": trial.model_dump(mode="json")}))
    recorded = load_resume_config(run).setup
    assert cli == api == trial.setup == recorded
    assert (api.page_size, api.flow.params["block_size"], api.flow.origin["block_size"]) == (8, 8, "user")
    assert api.flow.origin["budget_ratio"] == "published" and api.flow.spec == "quest"
    assert Setup.from_dict(json.loads(json.dumps(api.to_dict()))) == api


def test_an_exported_bundle_holds_the_trials_setup(tmp_path):
    from sparsetune.api import export

    trial = resolve(EngineConfig(model=MODEL), flow="quest", params=POINT, defaults="published")
    manifest = export(out=tmp_path / "b", flow="quest", params=POINT, model=MODEL, defaults="published")
    assert FlowSetup.from_dict(manifest["setup"]["flow"]) == trial.flow
    assert Setup.from_dict(manifest["setup"]).page_size == manifest["block_size"] == 8
    from sparsetune.export.bundle import MANIFEST, check_bundle

    assert check_bundle(tmp_path / "b") == []
    path = tmp_path / "b" / MANIFEST  # a setup that is not one
    broken = json.loads(path.read_text())
    broken["setup"]["schema"] = "sparsetune.setup/0"
    path.write_text(json.dumps(broken))
    assert any("setup is not a sparsetune.setup/1 object" in p for p in check_bundle(tmp_path / "b"))


@pytest.mark.tuned_defaults
def test_tuned_defaults_are_resolved_once_and_recorded():
    s = resolve(EngineConfig(model=MODEL), flow="quest", params={"budget": "512"})
    assert s.flow.origin["block_size"] == "tuned" and s.flow.origin["budget"] == "user"
    assert s.flow.origin["budget_ratio"] == "published"  # the user's budget replaced the tuned ratio
    assert s.flow.tuned["params"] == {"block_size": "2"} and s.page_size == 2
    assert Setup.from_dict(s.to_dict()) == s


def test_another_flow_keeps_the_pools_page_where_it_can_run_on_it():
    """`with_flow` on a setup whose pool has 2-token pages: a flow that leaves its block size unset
    runs on the pool's page; a two-level flow, whose pages must hold its units, keeps its own page
    (16) instead of failing, as a search's speed engine does between trials."""
    small = resolve(EngineConfig(model=MODEL), flow="block_topk", params={"block_size": "2"}, defaults="published")
    assert small.page_size == 2
    assert small.with_flow("quest", {"budget": "64"}, defaults="published").page_size == 2
    for flow, unit in (("quest_2l", "2"), ("block_topk_2l", "4")):
        s = small.with_flow(flow, {"select_block": unit}, defaults="published")
        assert (s.page_size, s.flow.params["block_size"], s.flow.origin["block_size"]) == (16, 16, "published")
    four = resolve(EngineConfig(model=MODEL), flow="block_topk", params={"block_size": "4"}, defaults="published")
    assert four.with_flow("quest_2l", {"select_block": "4"}, defaults="published").page_size == 16
    assert four.with_flow("quest_2l", {"select_block": "2"}, defaults="published").page_size == 4


def test_bad_setups_are_one_line():
    with pytest.raises(SparsetuneError, match="--param needs --flow"):
        resolve(params={"budget": "1"})
    with pytest.raises(SparsetuneError, match="--reuse-param needs a reuse flow"):
        resolve(reuse_params={"ratio": "0.1"})
    with pytest.raises(SparsetuneError, match="--flow-executor 'fast'"):
        resolve(flow="quest", executor="fast")
    with pytest.raises(SparsetuneError, match="not a sparsetune.setup/1 object"):
        Setup.from_dict({"schema": "x"})
    with pytest.raises(SparsetuneError, match="layer\\(s\\) \\[40\\] out of range"):
        resolve(flow="quest", params={"dense_layers": "40"})


def _calls(name: str) -> set[str]:
    """Modules of the package whose code calls `name` (as a function or an attribute)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called == name:
                    found.add(path.relative_to(PACKAGE.parent).as_posix())
    return found


def test_the_tuned_defaults_and_a_runs_flow_are_resolved_in_one_module():
    assert _calls("read_tuned_defaults") == {"sparsetune/setup.py"}  # the lookup
    assert _calls("tuned_defaults") == {"sparsetune/setup.py"}
    assert _calls("build_flow") == {"sparsetune/setup.py"}  # a flow built from a name and --param values
    # the class a name or file means: the loader's own lookup, called from the setup alone
    assert _calls("get_flow_class") - {"sparsetune/loader.py"} == {"sparsetune/setup.py"}


def test_what_llm_inherited_answers_with_a_deprecation_naming_its_place(smollm):
    with pytest.warns(DeprecationWarning, match="use llm.engine.scheduler"):
        assert smollm.scheduler is smollm.engine.scheduler
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        smollm.no_such_thing  # noqa: B018
    with pytest.warns(DeprecationWarning, match="LLM.apply"):
        smollm.set_flow("quest", {"budget": "64"})
    assert smollm.flow.name == "quest" and smollm.setup.flow.params["budget"] == 64
    smollm.apply(smollm.setup.with_flow(None))
    assert smollm.flow is None and smollm.setup.flow is None
    other = resolve(EngineConfig(model=MODEL, dtype="float16"), flow="quest")
    with pytest.raises(SparsetuneError, match="the setup is for dtype 'float16'.*needs a new LLM"):
        smollm.apply(other)


def test_an_eval_rerun_from_a_bundle_runs_the_trials_params(tmp_path):
    """The point a search measured, exported, and evaluated again from the bundle's setup: the same
    params in results.json (one engine for both: `llm=`; its own, as the point lays its pool out
    in 8-token blocks)."""
    from sparsetune.api import eval as run_eval, export
    from sparsetune.evaluation.config import EvalConfig
    from sparsetune.llm import LLM

    smollm = LLM(model=MODEL, device="cpu", max_num_seqs=8)

    small = dict(tasks=("niah_single",), context=256, samples=1, max_new_tokens=4, batch=1, fidelity=False,
                 mode="accuracy")
    trial = run_eval("quest", params=POINT, model=MODEL, device="cpu", defaults="published", out=tmp_path / "t",
                     llm=smollm, **small)
    manifest = export(out=tmp_path / "b", flow="quest", params=POINT, model=MODEL, defaults="published")
    bundle = Setup.from_dict(manifest["setup"])
    again = run_eval(config=EvalConfig(setup=bundle, **small), out=tmp_path / "again", llm=smollm)
    assert again["params"] == trial["params"] and again["flow"] == "quest"
    assert again["params"]["block_size"] == 8 and again["params"]["budget"] == 64


def test_a_flow_file_cannot_pass_for_a_built_in_in_its_setup(tmp_path):
    """The setup records the bytes the loader loaded: a file that names itself `quest` and declares
    quest's hash and path (traced, untrusted) is recorded as itself."""
    import hashlib

    from sparsetune.loader import builtin_hashes

    quest = next(h for h, name in builtin_hashes().items() if name == "quest.py")
    path = tmp_path / "fake.py"
    path.write_text(
        "from sparsetune.flow import DecodeFlow\nfrom sparsetune.flow import ops as F\n\n\n"
        f"class Quest(DecodeFlow):\n    name = \"quest\"\n    sha256 = \"{quest}\"\n    path = \"flows/quest.py\"\n\n"
        "    def cache(self, k, v):\n        return {\"c\": F.mean(k, dim=1)}\n\n"
        "    def index(self, q, fields):\n        return F.topk(F.max(F.gemm(fields[\"c\"], q), dim=2))\n")
    flow = resolve(flow=str(path), params={"budget": "64"}).flow
    assert flow.spec == str(path) and flow.source_sha256 == hashlib.sha256(path.read_bytes()).hexdigest() != quest
