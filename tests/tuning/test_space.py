"""The search space of a flow: its declared params as Optuna distributions (searched ranges from the
flow's `Search`, inherited by name from the base class), layer sets searched by size, and every
sampled point a valid flow with the runtime's layer rules."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FixedTrial

from sparsetune.loader import get_flow_class, load_file
from sparsetune.tuning.space import dimensions, layer_set, suggest

LAYERS = 30  # the embedded model


def _dims(name: str) -> dict:
    return {d.name: d for d in dimensions(get_flow_class(name), LAYERS)}


def test_quest_space_is_its_declared_params():
    dims = _dims("quest")
    assert list(dims) == ["block_size", "budget_ratio", "sink_blocks", "local_blocks", "dense_layers"]
    assert dims["block_size"].distribution == CategoricalDistribution((2, 4, 8, 16, 32))
    assert dims["budget_ratio"].distribution == FloatDistribution(1 / 64, 1 / 2, log=True)  # budget itself: off
    assert dims["sink_blocks"].distribution == IntDistribution(0, 4)
    assert dims["local_blocks"].distribution == IntDistribution(1, 8)
    # quest redeclares dense_layers (default: the first two) and inherits how it is searched
    assert dims["dense_layers"].layers == "first" and dims["dense_layers"].distribution == IntDistribution(0, 4)
    # select_layers is searched only by flows that share a selection across layers (tidal)
    tidal = _dims("tidal")["select_layers"]
    assert tidal.layers == "spread" and tidal.distribution == IntDistribution(1, 4)


def test_two_level_flows_search_the_unit_and_the_multiple_not_the_page():
    """The two-level built-ins keep the KV page (16, SGLang's page too) and sample the unit inside
    it and how many pages the first level keeps, on a log scale; each point is a two-level flow."""
    for name in ("quest_2l", "block_topk_2l", "double_sparse_2l"):
        dims = {d.name: d.distribution for d in dimensions(get_flow_class(name), LAYERS)}
        assert "block_size" not in dims
        assert dims["select_block"] == CategoricalDistribution((2, 4))
        assert dims["coarse"] == FloatDistribution(1.25, 8.0, log=True)
        flow = get_flow_class(name).from_strings({})
        assert (flow.block_size, flow.unit, flow.coarse) == (16, 2, 2.0) and flow.page_flow().unit == 16


def test_flow_specific_params_and_inapplicable_ones():
    assert _dims("h2o")["decay"].distribution == FloatDistribution(0.5, 1.0)
    assert _dims("double_sparse")["channels"].distribution == CategoricalDistribution((4, 8, 16, 32, 64))
    assert "calibration" not in _dims("double_sparse")  # a file: not a dimension
    assert _dims("double_sparse_2l")["channels"].distribution == CategoricalDistribution((16, 32, 64))  # its own Search
    streaming = _dims("streaming")
    assert "budget_ratio" not in streaming and "budget" not in streaming  # inapplicable to a window
    assert streaming["local_blocks"].distribution == IntDistribution(4, 512, log=True)  # its own Search
    assert _dims("dense") == {}


def test_a_flow_file_narrows_and_drops_dimensions(tmp_path):
    path = tmp_path / "narrow.py"
    path.write_text(
        "from sparsetune.flow import DecodeFlow, Param, Search\nfrom sparsetune.flow import ops as F\n\n\n"
        "class Narrow(DecodeFlow):\n    name = 'narrow'\n"
        "    block_size = Param(16, choices=(1, 2, 4, 8, 16, 32, 64), search=Search(choices=(2, 4)))\n"
        "    sink_blocks = Param(1, low=0, high=1024, search=Search(off=True))\n"
        "    alpha = Param(0.5, low=0.0, high=1.0, search=Search(low=0.25, high=0.75))\n\n"
        "    def cache(self, k, v):\n        return {'c': F.mean(k, dim=1)}\n\n"
        "    def index(self, q, fields):\n        return F.topk(F.max(F.gemm(q, fields['c']), dim=1))\n")
    dims = {d.name: d for d in dimensions(load_file(path), LAYERS)}
    assert dims["block_size"].distribution == CategoricalDistribution((2, 4))
    assert "sink_blocks" not in dims
    assert dims["alpha"].distribution == FloatDistribution(0.25, 0.75)


def test_layer_sets_by_size():
    assert layer_set("first", 3, LAYERS) == (0, 1, 2)
    assert layer_set("first", 0, LAYERS) == ()
    assert layer_set("spread", 0, LAYERS, dense=(0, 1, 2)) == ()  # every sparse layer selects
    assert layer_set("spread", 1, LAYERS, dense=(0, 1, 2)) == (3,)
    assert layer_set("spread", 3, LAYERS, dense=(0, 1, 2)) == (3, 12, 21)  # 27 sparse layers in thirds
    assert layer_set("spread", 40, 4, dense=(0,)) == (1, 2, 3)


def test_suggest_gives_param_strings_of_a_valid_flow():
    cls = get_flow_class("tidal")
    raw = suggest(FixedTrial({"block_size": 2, "budget_ratio": 0.125, "sink_blocks": 0, "local_blocks": 3,
                              "dense_layers": 2, "select_layers": 2}), cls, LAYERS)
    flow = cls.from_strings(raw)
    assert (flow.block_size, flow.budget_ratio, flow.sink_blocks, flow.local_blocks) == (2, 0.125, 0, 3)
    assert flow.dense_layers == (0, 1) and flow.select_layers == (2, 16)
    quest = get_flow_class("quest").from_strings(suggest(FixedTrial({"block_size": 2, "budget_ratio": 0.125, "sink_blocks": 0,
                                                                     "local_blocks": 3, "dense_layers": 2}), get_flow_class("quest"), LAYERS))
    assert quest.select_layers == ()  # not a dimension of quest: every sparse layer selects


def test_fixed_params_are_not_sampled_and_move_the_spread_layers():
    cls = get_flow_class("tidal")
    trial = FixedTrial({"block_size": 4, "budget_ratio": 0.25, "sink_blocks": 1, "local_blocks": 2, "select_layers": 2})
    raw = suggest(trial, cls, LAYERS, fixed={"dense_layers": "0,1,2,3", "budget_ratio": "0.0625"})
    assert raw["dense_layers"] == "0,1,2,3" and raw["budget_ratio"] == "0.0625"
    assert raw["select_layers"] == "4,17"  # spread over the sparse layers 4..29
    assert "dense_layers" not in trial.params and "budget_ratio" not in trial.params


@pytest.mark.parametrize("name", ["quest", "block_topk", "streaming", "h2o", "tidal", "double_sparse", "quest_2l",
                                  "block_topk_2l", "double_sparse_2l"])
def test_every_sampled_point_is_a_valid_flow(name):
    """Random points of the space build the flow, and its select layers start at the first sparse
    layer (the runtime's rule: later layers reuse that selection)."""
    cls = get_flow_class(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        flow = cls.from_strings(suggest(trial, cls, LAYERS))
        sparse = [i for i in range(LAYERS) if i not in flow.dense_layers]
        assert not flow.select_layers or flow.select_layers[0] == sparse[0]
        assert set(flow.select_layers) <= set(sparse)
        study.tell(trial, 0.0)


def _reuse(name: str):
    from sparsetune.reuse.base import ReuseFlow

    return get_flow_class(name, ReuseFlow)


def test_reuse_flows_search_their_layers_as_single_layers_capped_at_the_model():
    """A reuse flow's boundary or check layer is one layer ("index"): an integer in its range, capped
    at the model's last layer; a None default (sparsex: 15% of the layers) seeds the layer it stands for."""
    from sparsetune.tuning.studies import default_trial_params

    dims = {d.name: d for d in dimensions(_reuse("sparsex"), LAYERS)}
    assert list(dims) == ["ratio", "boundary_layer", "overflow", "tail"]
    assert dims["boundary_layer"].distribution == IntDistribution(0, 8) and dims["boundary_layer"].layers is None
    assert dims["ratio"].distribution == FloatDistribution(0.02, 0.6, log=True)  # shared by every reuse flow's ratio
    few = {d.name: d for d in dimensions(_reuse("sparsex"), 5)}
    assert few["boundary_layer"].distribution == IntDistribution(0, 4)  # a 5-layer model: capped
    assert default_trial_params(_reuse("sparsex"), LAYERS, {})["boundary_layer"] == round(0.15 * LAYERS)
    flow = _reuse("sparsex")()
    assert flow.selection_layer(LAYERS) == default_trial_params(_reuse("sparsex"), LAYERS, {})["boundary_layer"]
    assert {d.name: d for d in dimensions(_reuse("cacheblend"), LAYERS)}["check_layer"].distribution == IntDistribution(1, 6)
    assert dimensions(_reuse("pie"), LAYERS) == []  # nothing to tune


@pytest.mark.parametrize("name", ["sparsex", "cacheblend", "a3", "epic", "redknot", "loopserve"])
def test_every_sampled_point_is_a_valid_reuse_flow(name):
    cls = _reuse(name)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):
        trial = study.ask()
        flow = cls.from_strings(suggest(trial, cls, LAYERS))
        layer = flow.selection_layer(LAYERS)
        assert layer is None or 0 <= layer < LAYERS
        study.tell(trial, 0.0)


@pytest.mark.parametrize("flow", ["quest", "block_topk", "tidal", "h2o", "double_sparse", "streaming", "sparsex", "cacheblend",
                                  "quest_2l"])
def test_a_flow_class_crosses_a_process_boundary_as_its_params(flow):
    """What the search reads of a proposed flow comes from the sandbox as JSON: the class rebuilt
    from it has the same dimensions, defaults and seeds as the flow itself."""
    import json

    from sparsetune.flow.params import Flow
    from sparsetune.tuning.space import spec_class, spec_dicts
    from sparsetune.tuning.studies import seed_trials

    cls = get_flow_class(flow, Flow)
    spec = spec_class(json.loads(json.dumps(spec_dicts(cls))))
    assert dimensions(spec, 30) == dimensions(cls, 30)
    assert seed_trials(spec, 30, {}) == seed_trials(cls, 30, {})
    assert {k: p.default for k, p in spec.param_specs().items()} == {k: p.default for k, p in cls.param_specs().items()}
    assert spec.inapplicable == cls.inapplicable
    if flow == "quest_2l":  # None beside a default that is on (one level) crosses too
        assert spec.from_strings({"coarse": "off"}).params() == cls.from_strings({"coarse": "off"}).params()
