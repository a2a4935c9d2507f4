"""The command line, run as a user would: clear one-line errors, exit codes, JSON output."""

from __future__ import annotations

import json

import pytest
from helpers import assert_clean_error, run


def test_help_lists_commands():
    proc = run("--help")
    assert proc.returncode == 0
    for cmd in ("eval", "search", "profile", "export", "flows", "models", "generate"):
        assert cmd in proc.stdout


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_generate_json():
    proc = run("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "Paris" in out["text"]
    assert out["prompt_tokens"] > 5 and 0 < out["completion_tokens"] <= 12
    assert out["random_weights"] is False
    assert out["attended_tokens"] is None  # dense


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_generate_with_reused_segments(tmp_path):
    """--parts with --reuse: the segment misses, is computed and stored, then realigned into the
    prompt; the needle inside it is still read back."""
    doc = {"text": "The secret code of the blue door is 4417. The red door has no code at all.", "reuse": True,
           "namespace": "kb"}
    parts = tmp_path / "parts.json"
    parts.write_text(json.dumps(["Answer from the document.\n\n", doc, "\n\nWhat is the code of the blue door?"]))
    proc = run("generate", "--parts", str(parts), "--reuse", "sparsex", "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "4417" in out["text"]
    assert out["reuse"]["flow"] == "sparsex" and out["reuse"]["segment_misses"] == 1 and out["reuse"]["reuse_ratio"] > 0.2
    assert "segment cache lives in this process" in proc.stderr  # a later run computes the segment again


@pytest.mark.parametrize("args,needle", [
    (["--parts", "p.json"], "--parts needs a reuse flow"),
    (["--parts", "p.json", "--prompt", "hi", "--reuse", "pie"], "exactly one of --prompt TEXT and --parts FILE"),
    (["--parts", "missing.json", "--reuse", "pie"], "missing.json: no such file"),
    (["--parts", "bad.json", "--reuse", "pie"], "prompt[0].text: expected a non-empty string"),
])
def test_generate_parts_errors(tmp_path, args, needle):
    (tmp_path / "p.json").write_text('["hi"]')
    (tmp_path / "bad.json").write_text('[{"text": 3}]')
    args = [str(tmp_path / a) if a.endswith(".json") else a for a in args]
    assert_clean_error(run("generate", *args), needle)


def test_models_list_json():
    proc = run("models", "list", "--json")
    assert proc.returncode == 0
    names = {m["name"] for m in json.loads(proc.stdout)}
    assert {"smollm2-135m", "qwen3-8b", "qwen3-0.6b", "llama-3.1-8b"} <= names


def test_unknown_model():
    assert_clean_error(run("generate", "--model", "gpt-17", "--prompt", "hi"), "unknown model", "smollm2-135m")


def test_missing_weights(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub"), "SPARSETUNE_MODELS": str(tmp_path)}
    assert_clean_error(run("generate", "--model", "qwen3-8b", "--prompt", "hi", env=env),
                       "not found", "looked in", "--random-weights")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_clean_error(run("generate", "--model", str(tmp_path), "--prompt", "hi"), "unsupported architecture", "Qwen3")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--kv-memory", "lots"], "--kv-memory"),
        (["--device", "tpu"], "device"),
    ],
)
def test_bad_flags(args, needle):
    assert_clean_error(run("generate", "--prompt", "hi", *args), needle)


def test_empty_prompt():
    assert_clean_error(run("generate", "--prompt", "   "), "prompt is empty")


def test_prompt_longer_than_context():
    assert_clean_error(run("generate", "--prompt", "word " * 9000), "context holds 8192")


@pytest.mark.parametrize("args,needle", [
    (["--reuse", "quest"], "is a decode flow, not a reuse flow; pass it with --flow quest"),
    (["--reuse", "cacheblend", "--reuse-param", "ratio=2"], "must be in [0.0, 1.0]"),
    (["--reuse-param", "ratio=0.1"], "--reuse-param needs a reuse flow"),
    (["--flow", "sparsex"], "is a reuse flow, not a decode flow; pass it with --reuse sparsex"),
])
def test_eval_reuse_errors(args, needle):
    assert_clean_error(run("eval", "--task", "rag", "--samples", "1", *args), needle)
