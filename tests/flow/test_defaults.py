"""A model's tuned flow defaults: where they come from, which params they set, and that a run
records them (`setup.tuned_defaults`, `models.artifacts`)."""

from __future__ import annotations

import json

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune.engine.config import EngineConfig
from sparsetune.setup import describe_defaults as describe, resolve, tuned_defaults
from sparsetune.models.artifacts import artifact_path, read_tuned_defaults, save_tuned_defaults

MODEL = "smollm2-135m"
pytestmark = pytest.mark.tuned_defaults


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty per-user cache (the user's defaults files live beside the models cache)."""
    monkeypatch.setenv("SPARSETUNE_MODELS", str(tmp_path / "models"))
    return tmp_path


def test_the_embedded_model_ships_its_measured_defaults(cache):
    shipped = read_tuned_defaults(MODEL)
    for flow in ("quest", "block_topk"):  # BENCHMARKS.md, "Selection granularity": block 2 at 1/8
        assert shipped[flow]["params"] == {"block_size": "2", "budget_ratio": "0.125"}
        assert "Selection granularity" in shipped[flow]["source"]["from"]
    assert read_tuned_defaults(MODEL, random_weights=True) == {}  # never stands in for random weights
    assert read_tuned_defaults("qwen3-8b") == {}


def test_user_params_win_and_the_budget_is_one_setting(cache):
    params, taken = tuned_defaults(MODEL, False, "quest", {})
    assert params == {"block_size": "2", "budget_ratio": "0.125"} and taken["params"] == params
    params, taken = tuned_defaults(MODEL, False, "quest", {"block_size": "8"})
    assert params == {"block_size": "8", "budget_ratio": "0.125"} and taken["params"] == {"budget_ratio": "0.125"}
    # a token budget from the user replaces the tuned ratio (which would otherwise override it)
    params, taken = tuned_defaults(MODEL, False, "quest", {"budget": "512"})
    assert params == {"block_size": "2", "budget": "512"}
    # the engine's --block-size is the user's block size too, and an explicit 16 counts
    for size in (16, 8):
        setup = resolve(EngineConfig(model=MODEL, block_size=size), flow="quest")
        assert (setup.flow.params["block_size"], setup.flow.origin["block_size"], setup.page_size) == (size, "user", size)
        assert setup.flow.params["budget_ratio"] == 0.125 and setup.flow.origin["budget_ratio"] == "tuned"
    with pytest.raises(SparsetuneError, match="--block-size 8 disagrees with --param block_size=4; set it once"):
        resolve(EngineConfig(model=MODEL, block_size=8), flow="quest", params={"block_size": "4"})
    # everything set by the user: nothing taken
    assert tuned_defaults(MODEL, False, "quest", {"block_size": "4", "budget_ratio": "0.2"}) == (
        {"block_size": "4", "budget_ratio": "0.2"}, None)
    # dense, a flow file, a flow without tuned defaults: the params as given
    for flow in ("dense", "my_flow.py", "flows/x/quest", "h2o"):
        assert tuned_defaults(MODEL, False, flow, {"k": "1"}) == ({"k": "1"}, None)


def test_saved_defaults_override_the_shipped_ones_flow_by_flow(cache):
    path = save_tuned_defaults(MODEL, False, "quest", {"block_size": "4", "budget_ratio": "0.0625"},
                               {"study": "s", "trial": "quest#7"})
    assert path == artifact_path(MODEL, False, "defaults") and path.is_file()
    save_tuned_defaults(MODEL, False, "h2o", {"budget_ratio": "0.1"}, {"study": "s", "trial": "h2o#2"})
    got = read_tuned_defaults(MODEL)
    assert got["quest"]["params"] == {"block_size": "4", "budget_ratio": "0.0625"} and got["quest"]["file"] == str(path)
    assert got["h2o"]["params"] == {"budget_ratio": "0.1"}  # the second save kept the first
    assert got["block_topk"]["params"]["block_size"] == "2"  # still the shipped one
    _, taken = tuned_defaults(MODEL, False, "quest", {})
    line = describe("quest", MODEL, taken)
    assert "block_size=4" in line and "study s (quest#7)" in line and str(path) in line
    assert "published defaults" in describe("quest", MODEL, None) and describe("dense", MODEL, None) is None


def test_a_broken_defaults_file_is_one_clear_error(cache):
    path = artifact_path(MODEL, False, "defaults")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(SparsetuneError, match="tuned defaults file .* is not readable JSON.*--save-defaults"):
        read_tuned_defaults(MODEL)
    path.write_text(json.dumps({"model": MODEL, "flows": {"quest": {"params": {"block_size": 2}}}}))
    with pytest.raises(SparsetuneError, match="`flows` must map each flow"):
        read_tuned_defaults(MODEL)


def test_an_eval_config_records_the_defaults_it_took(cache):
    from sparsetune.evaluation.config import EvalConfig

    f = EvalConfig.of(model=MODEL, flow="quest", params={"sink_blocks": "2"}).setup.flow
    assert (f.params["block_size"], f.params["budget_ratio"], f.params["sink_blocks"]) == (2, 0.125, 2)
    assert f.tuned["params"] == {"block_size": "2", "budget_ratio": "0.125"}
    assert f.origin["sink_blocks"] == "user" and f.origin["block_size"] == "tuned" and f.origin["budget"] == "published"
    f = EvalConfig.of(model=MODEL, flow="quest", defaults="published").setup.flow
    assert f.params["block_size"] == 16 and f.params["budget_ratio"] is None and f.tuned is None
    with pytest.raises(SparsetuneError, match="--defaults 'mine': use tuned or published"):
        EvalConfig.of(model=MODEL, flow="quest", defaults="mine")


def test_an_engine_runs_the_tuned_defaults_and_a_published_one_does_not(cache):
    from sparsetune.llm import LLM

    save_tuned_defaults(MODEL, True, "quest", {"block_size": "8", "budget_ratio": "0.25"}, {"study": "t"})
    llm = LLM(model=MODEL, random_weights=True, device="cpu", flow="quest", num_kv_blocks=64, cuda_graph=False)
    assert (llm.flow.block_size, llm.flow.budget_ratio, llm.engine.kv.block_size) == (8, 0.25, 8)
    assert llm.setup.flow.tuned["params"] == {"block_size": "8", "budget_ratio": "0.25"}
    llm.apply(llm.setup.with_flow("quest", {"block_size": "4"}))  # a switch takes them under its params too
    assert (llm.flow.block_size, llm.flow.budget_ratio) == (4, 0.25)
    published = LLM(model=MODEL, random_weights=True, device="cpu", flow="quest", num_kv_blocks=64, defaults="published")
    assert (published.flow.block_size, published.flow.budget_ratio, published.setup.flow.tuned) == (16, None, None)
