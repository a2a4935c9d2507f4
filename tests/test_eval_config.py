"""The typed eval config and results (no model, no torch needed): a task file parsed once."""

from __future__ import annotations

import json

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune.evaluation import custom
from sparsetune.evaluation.config import EvalConfig, check_config


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
