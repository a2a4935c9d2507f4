"""`sparsetune profile` on CPU: the decode-step breakdown (Python API and command), run records, errors."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from sparsetune.cli.profile import profile as profile_command
from sparsetune.engine import ranges
from sparsetune.errors import SparsetuneError
from sparsetune.perf.step_profile import CATEGORIES, profile_decode

BATCH, CONTEXT = 2, 128


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small shared CPU, OpenMP threads contending with other work make
    every step several times slower, and nothing here depends on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llm(one_thread):
    from sparsetune.llm import LLM

    return LLM(model="smollm2-135m", device="cpu", random_weights=True, max_num_seqs=BATCH, max_model_len=256)


def check_common(r: dict) -> None:
    cats = r["categories"]
    assert list(cats) == [c for c in CATEGORIES if c in cats]  # display order
    assert all(v["ms"] >= 0 and v["percent"] >= 0 for v in cats.values())
    assert {"attention", "gemm", "norm", "rope", "activation", "sampling", "cache_update"} <= set(cats)
    assert cats["attention"]["ms"] > 0 and cats["gemm"]["ms"] > 0
    assert cats["cache_update"]["parts"]["kv store"] > 0
    assert r["sum_ms"] == pytest.approx(sum(v["ms"] for v in cats.values()), abs=1e-2)
    # On CPU the categories partition the profiled step's CPU time (self times of everything
    # under one range); the step's wall clock can only add the profiler's own gaps.
    assert 0.5 * r["profiled_step_ms"] <= r["sum_ms"] <= 1.2 * r["profiled_step_ms"]
    assert r["step_ms"] > 0 and r["timing"] == "CPU time" and not r["cuda_graphs"]
    assert (r["batch"], r["context"], r["device"]) == (BATCH, CONTEXT, "cpu")
    assert not ranges.ENABLED  # the stage ranges are off again


def test_dense_breakdown(llm, tmp_path):
    llm.apply(llm.setup.with_flow("dense"))
    r = profile_decode(llm, BATCH, CONTEXT, trace_path=tmp_path / "trace.json", steps=2, warmup=1)
    check_common(r)
    assert r["flow"] == "dense" and r["sparse_layers"] == 0
    assert "indexer" not in r["categories"] and "topk" not in r["categories"]
    assert "flow cache stage" not in r["categories"]["cache_update"]["parts"]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any("sparsetune::attention" == e.get("name") for e in trace["traceEvents"])
    assert not llm.engine.scheduler.has_work() and llm.engine.block_manager.num_free == llm.engine.kv.num_blocks  # engine idle again


def test_quest_breakdown(llm):
    llm.apply(llm.setup.with_flow("quest", {"budget": "64"}))
    try:
        r = profile_decode(llm, BATCH, CONTEXT, steps=2, warmup=1)
    finally:
        llm.apply(llm.setup.with_flow(None))
    check_common(r)
    assert r["flow"] == "quest" and r["flow_params"]["budget"] == 64
    assert r["sparse_layers"] == r["layers"] - 2 and r["executor"] == "reference"
    cats = r["categories"]
    assert cats["indexer"]["ms"] > 0 and cats["topk"]["ms"] > 0
    assert cats["cache_update"]["parts"]["flow cache stage"] > 0  # Quest's kmax/kmin (a block completes at 144)


def test_api_errors(llm):
    with pytest.raises(SparsetuneError, match="--batch must be at least 1"):
        profile_decode(llm, 0, CONTEXT)
    with pytest.raises(SparsetuneError, match="max_num_seqs"):
        profile_decode(llm, BATCH + 1, CONTEXT)
    with pytest.raises(SparsetuneError, match="exceeds the engine's context"):
        profile_decode(llm, 1, 250)


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(profile_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps `profile` as a named subcommand
    return app


def test_cli_writes_run_records(tmp_path):
    trace = tmp_path / "trace.json"
    args = ["profile", "--flow", "quest", "--param", "budget=32", "--random-weights", "--device", "cpu",
            "--batch", "1", "--context", "96", "--steps", "1", "--trace", str(trace), "--out", str(tmp_path / "runs"), "--json"]
    res = CliRunner().invoke(cli(), args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    [run_dir] = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-profile-quest-smollm2-135m")
    results = json.loads((run_dir / "results.json").read_text())
    assert results["flow"] == "quest" and results["flow_params"]["budget"] == 32 and "topk" in results["categories"]
    assert json.loads((run_dir / "env.json").read_text())["device"] == "cpu"
    assert (run_dir / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(trace.read_text())["traceEvents"]
    printed = json.loads(res.stdout)
    assert printed["categories"] == results["categories"]


@pytest.mark.parametrize("args, needle", [
    (["--batch", "0"], "--batch must be at least 1"),
    (["--context", "9000"], "too long for smollm2-135m"),
    (["--flow", "nope"], "unknown flow 'nope'"),
])
def test_cli_errors(tmp_path, args, needle):
    res = CliRunner().invoke(cli(), ["profile", "--random-weights", "--device", "cpu", "--out", str(tmp_path), *args])
    assert isinstance(res.exception, SparsetuneError), res.output
    assert needle in str(res.exception)
    assert not list(tmp_path.iterdir())  # no run directory for a failed run


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_cli_prints_the_table_on_stdout_without_profiler_notes(tmp_path):
    """Without --json the breakdown is the command's output (stdout); the profiler's native
    `USDT:` start/stop notes do not leak into the terminal."""
    from helpers import run

    proc = run("profile", "--random-weights", "--device", "cpu", "--batch", "1", "--context", "96", "--steps", "1",
               "--threads", "1", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "% of step" in proc.stdout and "sum" in proc.stdout
    assert "USDT" not in proc.stdout + proc.stderr
