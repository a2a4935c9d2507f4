"""The typed eval config and results (no model, no torch needed): results.json through `EvalResult`
unchanged, older files readable, config.json read back for --resume, a task file parsed once."""

from __future__ import annotations

import json

import pytest

from sparsetune.engine.config import EngineConfig
from sparsetune.errors import SparsetuneError
from sparsetune.evaluation import custom
from sparsetune.evaluation.config import CONFIG_SCHEMA, EvalConfig, check_config, load_resume_config
from sparsetune.evaluation.results import SCHEMA, EvalResult

FIDELITY = {"cosine": 0.998731, "top1": 0.9375, "top10": 0.95625, "positions": 16}
SPEED_RUN = {"ttft_s": {"p50": 0.12345, "max": 0.2}, "prefill_tokens_per_s": 4096.5, "decode_tokens_per_s": 120.25,
             "tpot_ms": {"p50": 8.1, "p95": 9.25}, "decode_steps": 3, "total_s": 0.51, "peak_memory_bytes": 123456,
             "peak_memory_kind": "process peak RSS (whole process, all phases)", "kv_pool_bytes": 4096, "batch": 2,
             "context": 256, "gen_tokens": 4, "preemptions": 0}
# A results.json as `evaluate` writes it today: every key, in its order.
RESULTS = {
    "schema": "sparsetune.eval/1", "run_dir": "runs/20250101-000000-quest-cacheblend-smollm2-135m", "flow": "quest",
    "model": "smollm2-135m", "params": {"budget": 64, "dense_layers": [0, 1], "budget_ratio": None}, "mode": "all",
    "context": 512, "samples_per_task": 2, "limit": None, "seed": 0, "device": "cuda:0", "dtype": "bfloat16",
    "note": None,
    "reuse": {"flow": "cacheblend", "params": {"ratio": 0.2}, "requests": 2, "reuse_ratio": 0.91, "recompute_ratio": 0.2,
              "compute_fraction": 0.27, "ttft_p50_s": 0.0123},
    "accuracy": 0.75, "dense_accuracy": 1.0, "relative_accuracy": 0.75,
    "tasks": {"niah_single": {"accuracy": 0.75, "n": 2, "total": 4, "dense_accuracy": 1.0, "fidelity": FIDELITY}},
    "fidelity": FIDELITY, "samples_done": 2, "samples_total": 2,
    "speed": {"flow": SPEED_RUN, "dense": SPEED_RUN, "decode_speedup": 1.0},
    "preemptions": 0, "complete": True, "started": "2025-01-01T00:00:00+0000", "finished": "2025-01-01T00:01:00+0000",
    "seconds": 60.0,
}


def test_results_json_round_trips_unchanged(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS, indent=2) + "\n")
    res = EvalResult.read(path)
    assert res.schema_version == SCHEMA and res.tasks["niah_single"].fidelity.top1 == 0.9375
    assert res.speed.flow.decode_tokens_per_s == 120.25 and res.reuse.mlp_fraction is None
    res.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()  # same keys, order and layout
    assert EvalResult.read(tmp_path).dump() == RESULTS  # a run directory reads too


def test_optional_blocks_stay_absent_and_unknown_keys_are_kept():
    speed_only = {k: v for k, v in RESULTS.items() if k not in ("reuse", "samples_done", "samples_total")}
    speed_only |= {"accuracy": None, "dense_accuracy": None, "relative_accuracy": None, "tasks": {}, "fidelity": None,
                   "speed": {"flow": {**SPEED_RUN, "timing": "events"}, "dense": None, "decode_speedup": None}}
    res = EvalResult.model_validate({**speed_only, "from_a_newer_version": {"x": 1}})
    assert res.reuse is None and res.samples_done is None
    assert res.dump() == {**speed_only, "from_a_newer_version": {"x": 1}}


def test_a_broken_results_file_is_one_clear_error(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"schema": SCHEMA, "flow": "quest"}))
    with pytest.raises(SparsetuneError, match="not a readable results.json"):
        EvalResult.read(tmp_path)


def test_keyword_options_split_into_engine_and_eval_fields():
    cfg = EvalConfig.of(flow="quest", params={"budget_ratio": 0.125}, model="smollm2-135m", tasks=["vt"], context=512,
                        device="cpu", seed=3, batch=2)
    assert cfg.setup.engine == EngineConfig(model="smollm2-135m", device="cpu", seed=3, block_size=16)
    assert cfg.setup.flow.name == "quest" and cfg.setup.flow.params["budget_ratio"] == 0.125
    assert cfg.tasks == ("vt",) and cfg.context == 512 and cfg.batch == 2
    with pytest.raises(TypeError, match="unknown eval option 'budget'"):
        EvalConfig.of(budget=3)
    with pytest.raises(SparsetuneError, match="--context must be at least 16"):
        EvalConfig.of(context=8)


def _run_dir(tmp_path, block):
    (tmp_path / "config.json").write_text(json.dumps({"schema": CONFIG_SCHEMA, "eval": block}))
    return tmp_path


def test_config_json_reads_back_for_resume(tmp_path):
    cfg = EvalConfig.of(flow="quest", params={"budget": 64, "dense_layers": [0, 1]}, tasks=["vt"], kv_memory=2**30,
                        cuda_graph_batch_sizes=(1, 2))
    assert load_resume_config(_run_dir(tmp_path, cfg.model_dump(mode="json"))) == cfg


def test_config_json_of_schema_1_reads(tmp_path):
    """Run directories made before the engine options moved under `engine`: a flat eval block."""
    old = {"flow": "quest", "model": "smollm2-135m", "tasks": None, "context": 1024, "samples": 4, "seed": 0,
           "params": {"budget": "64"}, "batch": 8, "max_new_tokens": None, "mode": "auto", "fidelity": True,
           "device": "auto", "dtype": "auto", "random_weights": False, "kv_memory": None, "flow_executor": None,
           "cuda_graph": True, "reuse": None, "reuse_params": {}, "limit": 2}
    cfg = load_resume_config(_run_dir(tmp_path, old))
    assert cfg.setup.flow.name == "quest" and cfg.setup.flow.params["budget"] == 64 and cfg.limit == 2


def test_a_task_file_is_parsed_once(tmp_path, monkeypatch):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "What is the capital of France?", "answers": ["Paris"]}) + "\n")
    parses = []
    parse = custom._parse
    monkeypatch.setattr(custom, "_parse", lambda *a: parses.append(a) or parse(*a))
    check_config(EvalConfig(tasks=[str(f)]))
    check_config(EvalConfig(tasks=[str(f)]))
    assert len(custom.load_jsonl(f)) == 1 and len(parses) == 1
    f.write_text(json.dumps({"prompt": "hi", "answers": ["x"]}) + "\n" + json.dumps({"prompt": "hi", "answers": "x"}))
    for _ in range(2):  # an edited file is read again, and its error said each time
        with pytest.raises(SparsetuneError, match="t.jsonl:2: \"answers\" must be"):
            check_config(EvalConfig(tasks=[str(f)]))
