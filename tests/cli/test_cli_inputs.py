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
    (tmp_path / "no_weights" / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "malformed.jsonl").write_text('{"prompt": "p", "answers": ["a"]}\n{"prompt": "p"\n')
    (tmp_path / "empty.json").write_text("[]")
    for name, config in (("config_not_utf8", b'{"model_type": "llama", "name": "\xff"}'),
                         ("config_list", b"[1]"),
                         ("hidden_size_str", json.dumps({**TINY, "hidden_size": "sixty-four"}).encode()),
                         ("negative_layers", json.dumps({**TINY, "num_hidden_layers": -2}).encode())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(config)
    for name, block in (("resume_list", [1]), ("resume_partial", {"engine": {"model": "smollm2-135m"}, "tasks": ["vt"]}),
                        ("resume_bad_value", {**_resume_block(), "context": "long"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(block if isinstance(block, list) else
                                                                {"schema": "sparsetune.eval.config/2", "eval": block}))
    (tmp_path / "a_file").write_text("not a folder")
    for name in ("truncated_weights", "bad_tokenizer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(TINY))
        header = json.dumps({"embed": {"dtype": "F32", "shape": [256, 64], "data_offsets": [0, 4 * 256 * 64]}}).encode()
        (tmp_path / name / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(100))
    (tmp_path / "bad_tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')
    return {k: str(tmp_path / k) for k in ("no_config", "no_weights", "empty.jsonl", "malformed.jsonl", "empty.json",
                                           "config_not_utf8", "config_list", "hidden_size_str", "negative_layers",
                                           "resume_list", "resume_partial", "resume_bad_value", "a_file",
                                           "truncated_weights", "bad_tokenizer")}


# A tiny Llama's config.json (no weights: what a model folder's config checks need).
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256}


def _resume_block() -> dict:
    """A complete eval config block, as `evaluate` writes it to a run folder's config.json."""
    from sparsetune.evaluation.config import EvalConfig

    return EvalConfig(tasks=["vt"]).model_dump(mode="json")


def _fill(args: tuple[str, ...], files: dict[str, str]) -> list[str]:
    """The arguments with each name of `files` (alone, or as the first part of a path) made its path."""
    return [files[a.partition("/")[0]] + a[len(a.partition("/")[0]):] if a.partition("/")[0] in files else a
            for a in args]


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
    (("export", "runs/s", "--flow", "quest", "--out", "b"), ("a search's run folder (runs/<study>), or a --flow",)),
    (("export", "--check", "b", "--flow", "quest"), ("--check takes only the bundle's folder",)),
    (("models", "path", "/nonexistent/m"), ("model directory /nonexistent/m does not exist",)),
    (("models", "path", "qwen3-8b"), ("weights for qwen3-8b not found", "--random-weights")),
    (("generate", "--model", "config_not_utf8", "--prompt", "hi"), ("config_not_utf8/config.json", "not UTF-8")),
    (("eval", "--model", "config_list"), ("config_list/config.json", "not a JSON object")),
    (("eval", "--model", "hidden_size_str"), ("hidden_size must be a positive integer", "'sixty-four'",
                                              "hidden_size_str/config.json")),
    (("generate", "--model", "negative_layers", "--random-weights", "--prompt", "hi"),
     ("num_hidden_layers must be a positive integer (got -2)", "negative_layers/config.json")),
    (("eval", "--resume", "resume_list"), ("--resume", "config.json is not an eval run's config",
                                           "pass a run directory made by sparsetune eval")),
    (("eval", "--resume", "resume_partial"), ("--resume", "config.json lacks 'context'", "not a resumable eval run")),
    (("eval", "--resume", "resume_bad_value"), ("--resume", "context: Input should be a valid integer",
                                                "not a resumable eval run")),
    (("profile", "--trace", "a_file/trace.json"), ("--trace", "a_file is a file, not a folder")),
    (("profile", "--out", "a_file/runs"), ("--out", "a_file is a file, not a folder")),
    (("bench", "serve", "--out", "a_file/runs"), ("--out", "a_file is a file, not a folder")),
]


@pytest.mark.parametrize("args,needles", BEFORE_TORCH, ids=[" ".join(a) for a, _ in BEFORE_TORCH])
def test_refused_before_torch_loads(args, needles, files, no_torch, tmp_path):
    out = tmp_path / "runs"
    extra = ["--out", str(out)] if args[0] == "eval" else []
    proc = run(*_fill(args, files), *extra, env=no_torch)
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, *needles)
    assert "search" not in args or "issue" not in proc.stderr  # no internal issue numbers in user messages
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # the error is the one line
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
    (("eval", "--flow", "quest", "--param", "budget_ratio=nan"), ("--param budget_ratio=nan: must be a finite number",)),
    (("eval", "--reuse", "sparsex", "--reuse-param", "ratio=nan"), ("--param ratio=nan: must be a finite number",)),
    (("generate", "--prompt", "hi", "--flow", "quest", "--param", "budget_ratio=inf"),
     ("--param budget_ratio=inf: must be a finite number",)),
    (("profile", "--flow", "quest", "--param", "budget_ratio=-inf"), ("--param budget_ratio=-inf: must be a finite number",)),
    (("bench", "serve", "--flow", "quest", "--param", "budget_ratio=nan"),
     ("--param budget_ratio=nan: must be a finite number",)),
    (("export", "--flow", "quest", "--param", "budget_ratio=nan"), ("--param budget_ratio=nan: must be a finite number",)),
    (("generate", "--model", "truncated_weights", "--prompt", "hi"), ("truncated_weights/model.safetensors",
                                                                      "incomplete or damaged")),
    (("generate", "--model", "bad_tokenizer", "--prompt", "hi"), ("cannot load the tokenizer", "bad_tokenizer",
                                                                  "damaged or of a kind")),
]


@pytest.mark.parametrize("args,needles", AFTER_TORCH, ids=[" ".join(a) for a, _ in AFTER_TORCH])
def test_refused_without_a_run_directory(args, needles, files, tmp_path):
    out = tmp_path / "runs"
    extra = ["--out", str(out), "--task", "niah_single", "--samples", "1", "--context", "256"] if args[0] == "eval" else []
    extra += ["--out", str(out)] if args[0] in ("search", "bench", "profile", "export") else []
    proc = run(*_fill(args, files), *extra)
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
    code = ("from sparsetune.loader import build_flow\n"
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
    assert_clean_error(proc, "long sample 1 (line 2)", "shorten its prompt", "--context does not resize")
    assert "lower --context" not in proc.stderr
    assert not out.exists()


def test_agent_claude_without_a_key_names_it_and_the_alternatives(tmp_path, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    out = tmp_path / "runs"
    proc = run("search", "--agent", "claude", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, "--agent claude needs ANTHROPIC_API_KEY", "--agent-endpoint", "--agent evolve")
    assert not out.exists()


def test_a_context_too_small_for_the_prompt_names_its_own_fix():
    """--max-model-len caps the context: raising it is the fix, not --kv-memory."""
    proc = run("generate", "--prompt", "hi", "--max-model-len", "4")
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, "--max-model-len 4 is too small for the", "raise --max-model-len to")
    assert "--kv-memory" not in proc.stderr


_TRAPPED = """
import io, json, sys
import sparsetune.engine.engine as engine, sparsetune.models.resolve as resolve
from sparsetune.cli.main import main

def trap(*args, **kwargs):
    raise SystemExit("the model was loaded")

resolve.resolve_model = engine.resolve_model = trap
engine.Engine.__init__ = trap
results = []
for args in json.loads(sys.argv[1]):
    sys.argv, sys.stderr = ["sparsetune", *args], io.StringIO()
    try:
        main()
    except SystemExit as e:
        results.append([e.code, sys.stderr.getvalue()])
sys.stdout.write(json.dumps(results))
"""


def test_flows_and_params_are_checked_before_the_model_loads(tmp_path):
    """A wrong flow name or --param value is refused before the model is resolved or its engine built
    (the loaders are booby-trapped; one process runs every case)."""
    out = ["--out", str(tmp_path / "runs")]
    cases = [
        (["eval", "--flow", "nosuch", "--task", "niah_single", *out], "unknown flow 'nosuch'"),
        (["eval", "--flow", "quest", "--param", "budget=abc", "--task", "niah_single", *out], "expected int"),
        (["eval", "--flow", "quest", "--param", "dense_layers=99", "--task", "niah_single", *out],
         "out of range for a 30-layer model"),
        (["eval", "--reuse", "sparsex", "--reuse-param", "nosuch=1", "--task", "rag", *out], "has no parameter 'nosuch'"),
        (["generate", "--prompt", "hi", "--flow", "quest", "--param", "dense_layers=99"], "out of range for a 30-layer"),
        (["profile", "--flow", "quest", "--param", "select_layers=5", *out], "the first sparse layer (2) must select"),
        (["bench", "serve", "--flow", "quest", "--param", "dense_layers=99", *out], "out of range for a 30-layer"),
    ]
    proc = subprocess.run([sys.executable, "-c", _TRAPPED, json.dumps([a for a, _ in cases])], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    for (args, needle), (code, stderr) in zip(cases, json.loads(proc.stdout)):
        assert code == 2 and "error: " in stderr and needle in stderr, (args, code, stderr)
    assert not (tmp_path / "runs").exists()


def test_a_run_folder_where_none_can_be_made_is_refused_before_torch(tmp_path, no_torch):
    """--out under a file (no folder can be made there), and --resume of a read-only run folder."""
    (tmp_path / "a_file").write_text("not a folder")
    proc = run("eval", "--out", str(tmp_path / "a_file" / "runs"), env=no_torch)
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, f"--out {tmp_path / 'a_file' / 'runs'}", "a_file is a file, not a folder",
                       "pick another --out")


def _read_only(folder: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    """The command with `folder` a read-only file system (a tmpfs mounted ro in a mount namespace of
    its own: permission bits would not stop root); skipped where namespaces or mounts are not allowed."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {folder}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a read-only file system here (needs root and mount namespaces)")
    cmd = f"mount -t tmpfs -o ro tmpfs {folder} && exec {sys.executable} -m sparsetune.cli.main " + " ".join(args)
    return subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


@pytest.mark.parametrize("args", [("eval", "--out", "{ro}/runs"), ("bench", "serve", "--out", "{ro}/runs"),
                                  ("profile", "--trace", "{ro}/trace.json", "--out", "{tmp}/runs")])
def test_a_read_only_file_system_is_refused_before_torch(args, tmp_path, no_torch):
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = _read_only(ro, *(a.format(ro=ro, tmp=tmp_path) for a in args), env=no_torch)
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, f"{ro} is not writable", "pick another")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args, needle", [(("flows", "new", "mine", "--out", "{ro}/mine.py"), "cannot write"),
                                          (("export", "--flow", "quest", "--out", "{ro}/b"), "cannot write the bundle")])
def test_writing_into_a_read_only_file_system_is_one_line(args, needle, tmp_path):
    """`flows new` and `export` into a read-only folder were tracebacks (#40)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = _read_only(ro, *(a.format(ro=ro) for a in args), env={})
    assert proc.returncode == 2, proc.stderr
    assert_clean_error(proc, needle)
    assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1, proc.stderr
