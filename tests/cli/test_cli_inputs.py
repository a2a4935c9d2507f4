"""Bad input through the real entry point, as a new user types it: exit 2, one `error:` line that
names the problem and the fix, no traceback, no run directory where nothing ran, and the checks
that need no model fail before torch is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_clean_error, run

FLOWS = Path(__file__).resolve().parents[2] / "flows"


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict[str, str]:
    """An environment in which `import torch` fails: a command that still gives its own clean
    error there checked its arguments before loading torch."""
    d = tmp_path_factory.mktemp("no_torch")
    (d / "torch").mkdir()
    (d / "torch" / "__init__.py").write_text('raise ImportError("torch was imported before the arguments were checked")\n')
    return {"PYTHONPATH": os.pathsep.join([str(d), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.fixture()
def files(tmp_path) -> dict[str, str]:
    """Bad inputs on disk: model folders without config or weights, empty and malformed task files."""
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256}))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "malformed.jsonl").write_text('{"prompt": "p", "answers": ["a"]}\n{"prompt": "p"\n')
    (tmp_path / "empty.json").write_text("[]")
    return {k: str(tmp_path / k) for k in ("no_config", "no_weights", "empty.jsonl", "malformed.jsonl", "empty.json")}


def _fill(args: tuple[str, ...], files: dict[str, str]) -> list[str]:
    return [files.get(a, a) for a in args]


# (arguments, words the error line must hold): each is refused before torch loads.
BEFORE_TORCH = [
    (("eval", "--model", "/nonexistent"), ("/nonexistent does not exist",)),
    (("generate", "--model", "/nonexistent", "--prompt", "hi"), ("/nonexistent does not exist",)),
    (("eval", "--model", "no_config"), ("has no config.json",)),
    (("generate", "--model", "no_weights", "--prompt", "hi"), ("no *.safetensors", "--random-weights")),
    (("eval", "--model", "gpt-17"), ("unknown model 'gpt-17'", "smollm2-135m")),
    (("eval", "--context", "10000000"), ("10000000 prompt tokens", "context length of 8192", "lower --context")),
    (("eval", "--context", "9000"), ("9000 prompt tokens", "context length of 8192")),
    (("eval", "--context", "8"), ("--context must be at least 16",)),
    (("eval", "--task", "nosuch"), ("unknown task 'nosuch'", "niah_single")),
    (("eval", "--task", "empty.jsonl"), ("no tasks in the file",)),
    (("eval", "--task", "malformed.jsonl"), ("malformed.jsonl:2", "not valid JSON")),
    (("eval", "--mode", "fast"), ("--mode 'fast'", "accuracy")),
    (("eval", "--batch", "0"), ("--batch must be at least 1",)),
    (("eval", "--limit", "0"), ("--limit must be at least 1",)),
    (("eval", "--max-new-tokens", "0"), ("--max-new-tokens must be at least 1",)),
    (("eval", "--kv-memory", "4XB"), ("--kv-memory '4XB' is not a size",)),
    (("eval", "--device", "tpu"), ("unknown device 'tpu'", "cuda:N")),
    (("eval", "--dtype", "fp8"), ("unknown dtype 'fp8'",)),
    (("eval", "--param", "budget"), ("write key=value",)),
    (("eval", "--resume", "/nonexistent/run"), ("--resume /nonexistent/run: no such directory",)),
    (("eval", "--resume", "no_config"), ("no config.json there",)),
    (("eval", "--random-weights", "--mode", "accuracy"), ("accuracy needs real weights",)),
    (("generate", "--prompt", "hi", "--max-model-len", "0"), ("--max-model-len must be at least 1",)),
    (("generate", "--prompt", "hi", "--block-size", "3"), ("--block-size must be a power of two",)),
    (("generate", "--prompt", "  "), ("the prompt is empty",)),
    (("generate", "--parts", "empty.json", "--reuse", "pie"), ("non-empty JSON list",)),
    (("generate", "--prompt", "hi", "--kv-memory", "0"), ("--kv-memory must be at least 1",)),
    (("flows", "new", "x", "--out", "/nonexistent/dir/x.py"), ("/nonexistent/dir does not exist", "mkdir -p")),
    (("eval", "--context", "abc"), ("Invalid value for '--context'", "sparsetune eval --help")),
    (("eval", "-n", "2"), ("No such option: -n", "sparsetune eval --help")),
    (("models", "list", "--json", "true"), ("unexpected extra argument", "sparsetune models list --help")),
    (("search", "--min-accuracy", "2"), ("--min-accuracy is a share of dense accuracy in (0, 1]",)),
    (("search", "--study", "a/b"), ("--study 'a/b': use letters",)),
    (("search", "--reuse", "sparsex", "--flow", "quest"), ("--flow and --reuse: a search is of decode flows or of reuse flows",)),
    (("search", "--save-defaults"), ("--save-defaults needs --min-accuracy",)),
    (("search", "--reuse", "sparsex", "--save-defaults", "--min-accuracy", "0.9"), ("--save-defaults: tuned defaults are for decode flows",)),
    (("eval", "--flow", "quest", "--defaults", "mine"), ("--defaults 'mine': use tuned or published",)),
    (("search", "show", "nowhere"), ("not a search folder",)),
    (("export",), ("--out DIR: where to write the bundle",)),
    (("export", "runs/s", "--flow", "quest", "--out", "b"), ("a search's run folder (runs/<study>) or a --flow",)),
    (("export", "--check", "b", "--flow", "quest"), ("--check takes only the bundle's folder",)),
    (("models", "path", "/nonexistent/m"), ("model directory /nonexistent/m does not exist",)),
    (("models", "path", "qwen3-8b"), ("weights for qwen3-8b not found", "--random-weights")),
]


@pytest.mark.parametrize("args,needles", BEFORE_TORCH, ids=[" ".join(a) for a, _ in BEFORE_TORCH])
def test_refused_before_torch_loads(args, needles, files, no_torch, tmp_path):
    out = tmp_path / "runs"
    extra = ["--out", str(out)] if args[0] == "eval" else []
    proc = run(*_fill(args, files), *extra, env=no_torch)
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, *needles)
    assert "search" not in args or "issue" not in proc.stderr  # no internal issue numbers in user messages
    assert not out.exists()  # nothing ran, nothing on disk


# Refused once flows or the model load (torch is imported), still before any run directory exists.
AFTER_TORCH = [
    (("eval", "--flow", "nosuch"), ("unknown flow 'nosuch'",)),
    (("eval", "--flow", "quest", "--param", "budget=abc"), ("--param budget='abc': expected int",)),
    (("eval", "--flow", "quest", "--param", "nosuch=1"), ("has no parameter 'nosuch'",)),
    (("eval", "--flow", "quest", "--param", "dense_layers=99"), ("out of range for a 30-layer model",)),
    (("eval", "--device", "cuda"), ("no CUDA GPU is visible", "--device cpu")),
    (("eval", "--threads", "0"), ("--threads must be at least 1",)),
    (("generate", "--prompt", "hi", "--flow", "quest", "--param", "budget_ratio=2"), ("must be in [0.0, 1.0]",)),
    (("flows", "show", "nosuch"), ("unknown flow 'nosuch'",)),
    (("flows", "show", "qeust"), ("unknown flow 'qeust'; did you mean 'quest'?",)),
    (("generate", "--prompt", "hi", "--kv-memory", "100TiB"), ("the KV pool needs", "lower --batch or --context")),
    (("search", "--flow", "nosuch"), ("unknown flow 'nosuch'",)),
    (("search", "--flow", "quest", "--param", "nosuch=1"), ("--param nosuch: quest has no such param",)),
    (("search", "--flow", "sparsex"), ("--flow sparsex: a reuse flow; search it with --reuse sparsex",)),
    (("search", "--reuse", "quest"), ("--reuse quest: a decode flow; search it with --flow quest",)),
    (("search", "--reuse", "pie"), ("--reuse pie: it has no param to search",)),
    (("search", "--reuse", "cacheblend", "--task", "niah_single"), ("--task niah_single: no reusable segments",)),
    (("search", "--storage", "postgresql://u@127.0.0.1:1/x"), ("cannot open it", "check the URL and that the server runs")),
    (("search", "--flow", "quest", "--context", "512"), ("--context 512 is too small for cwe", "raise --context")),
    (("bench", "serve", "--schedule", "soon"), ("--schedule 'soon': use one of prefill_first, interleave",)),
    (("search", "--workers", "0"), ("--workers must be at least 1",)),
    (("search", "--agent", "nosuch"), ("--agent 'nosuch': use one of evolve, claude, openai",)),
    (("search", "--agent", "evolve", "--workers", "2"), ("--agent with --workers", "use --workers 1")),
    (("search", "--agent", "openai", "--agent-model", "m"), ("--agent openai needs --agent-endpoint URL",)),
    (("search", "--agent", "evolve", "--reuse", "sparsex"), ("--agent writes decode flows",)),
    (("search", "--flow", "streaming", "--speed-context", "32768"), ("attends a fixed window of tokens",
                                                                     "search it with --speed-context 1024")),
]


@pytest.mark.parametrize("args,needles", AFTER_TORCH, ids=[" ".join(a) for a, _ in AFTER_TORCH])
def test_refused_without_a_run_directory(args, needles, tmp_path):
    out = tmp_path / "runs"
    extra = ["--out", str(out), "--task", "niah_single", "--samples", "1", "--context", "256"] if args[0] == "eval" else []
    extra += ["--out", str(out)] if args[0] in ("search", "bench") else []
    proc = run(*args, *extra)
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, *needles)
    assert not out.exists()


def test_models_list_and_version_do_not_load_torch(no_torch):
    proc = run("models", "list", "--json", env=no_torch)
    assert proc.returncode == 0, proc.stderr
    assert any(m["name"] == "smollm2-135m" and m["weights"] == "embedded" for m in json.loads(proc.stdout))
    proc = run("--version", env=no_torch)
    assert proc.returncode == 0 and proc.stdout.startswith("sparsetune ")


def test_help_shows_flags_as_flags():
    """`--json` takes no value, so help must not label it `<bool>` (typer's rich help did)."""
    for args in (("eval", "--help"), ("flows", "list", "--help"), ("models", "list", "--help")):
        proc = run(*args)
        assert proc.returncode == 0 and "--json" in proc.stdout and "<bool>" not in proc.stdout, proc.stdout


def test_flows_show_prints_the_whole_source_to_a_pipe():
    proc = run("flows", "show", "redknot")
    assert proc.returncode == 0, proc.stderr
    source = (FLOWS / "redknot.py").read_text()
    assert max(map(len, source.splitlines())) > 80  # the case that was cut at 80 columns
    assert proc.stdout == source


def test_flows_new_then_check(tmp_path):
    target = tmp_path / "my_flow.py"
    proc = run("flows", "new", "my_flow", "--out", str(target))
    assert proc.returncode == 0 and proc.stdout.strip() == str(target), proc.stderr
    proc = run("flows", "check", str(target), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stderr


def test_python_api_takes_typed_params():
    """`params={"budget_ratio": 0.125}` as anyone writes it; a wrong type is one clear error."""
    code = ("from sparsetune.registry import build_flow\n"
            "f = build_flow('quest', {'budget_ratio': 0.125, 'budget': 512, 'dense_layers': [0, 1], 'block_size': 2})\n"
            "print(f.budget_ratio, f.budget, f.dense_layers, f.block_size)\n"
            "from sparsetune.errors import SparsetuneError\n"
            "try:\n    build_flow('quest', {'budget': 'lots'})\nexcept SparsetuneError as e:\n    print(e)\n"
            "try:\n    build_flow('quest', {'budget': 1.5})\nexcept SparsetuneError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["0.125 512 (0, 1) 2", "--param budget='lots': expected int",
                                        "--param budget=1.5: expected int"]


def test_a_custom_prompt_too_long_is_refused_before_the_run_directory(tmp_path):
    """Custom samples are not resized: one longer than a request can hold names its line, and
    nothing is left on disk."""
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "answers": ["a"]}) + "\n"
                 + json.dumps({"prompt": "word " * 9000, "answers": ["a"]}) + "\n")
    out = tmp_path / "runs"
    proc = run("eval", "--task", str(f), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, "long sample 1 (line 2)", "lower --context or --max-new-tokens")
    assert not out.exists()


def test_agent_claude_without_a_key_names_it_and_the_alternatives(tmp_path, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    out = tmp_path / "runs"
    proc = run("search", "--agent", "claude", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, "--agent claude needs ANTHROPIC_API_KEY", "--agent-endpoint", "--agent evolve")
    assert not out.exists()
