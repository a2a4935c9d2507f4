"""`sparsetune eval` on CPU: accuracy of the real default model, fidelity by teacher forcing,
run records (schema, partial records on interrupt, resume), custom JSONL, speed mode, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sparsetune.engine.sequence import SamplingParams
from sparsetune.errors import SparsetuneError
from sparsetune.api import eval as evaluate
from sparsetune.evaluation.runner import read_records, summarize
from helpers import assert_clean_error, run, sigint_default

TOP_KEYS = {"flow", "model", "params", "accuracy", "tasks", "fidelity", "speed", "complete"}


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_dense_reads_the_needle_at_1k(smollm, tmp_path):
    """The issue's bar: dense accuracy of the default model on niah_single at 1K >= 0.9 (8 samples)."""
    smollm.apply(smollm.setup.with_flow(None))
    res = evaluate("dense", tasks=["niah_single"], context=1024, samples=8, batch=8, out=tmp_path, llm=smollm)
    assert res["tasks"]["niah_single"]["n"] == 8
    assert res["accuracy"] >= 0.9, res
    assert res["complete"] and res["fidelity"] is None and res["speed"] is None
    run_dir = tmp_path / os.listdir(tmp_path)[0]
    assert {p.name for p in run_dir.iterdir()} >= {"config.json", "env.json", "samples.jsonl", "results.json"}
    assert json.loads((run_dir / "results.json").read_text()) == res
    recs = read_records(run_dir)
    assert len(recs) == 8 and all(len(r["prompt_sha256"]) == 1 for r in recs)
    assert all(abs(r["prompt_tokens"][0] - 1024) <= 0.05 * 1024 for r in recs)
    assert summarize(recs)["accuracy"] == res["accuracy"]
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["eval"]["context"] == 1024 and cfg["flow"]["name"] == "dense" and cfg["model"]["name"] == "smollm2-135m"
    env = json.loads((run_dir / "env.json").read_text())
    assert env["packages"]["torch"] and env["device"] == "cpu"


def test_teacher_forced_decode_equals_prefill(smollm):
    """Forced tokens through decode steps give the logits a prefill of the whole sequence gives
    (an independent path: prompt_logits runs the tokens as one prompt)."""
    smollm.apply(smollm.setup.with_flow(None))
    ids = smollm.tokenizer.chat_prompt("Name three colours.")
    forced = (504, 2379, 28, 253, 1016)
    seq = smollm.engine.add_request(ids, SamplingParams(max_tokens=5, forced_tokens=forced, ignore_eos=True, keep_logits=True))
    while smollm.engine.scheduler.has_work():
        smollm.engine.step()
    assert seq.completion_ids == list(forced)
    decoded = torch.stack(seq.logits)
    ref = smollm.engine.prompt_logits(ids + list(forced[:-1]))[len(ids) - 1:]
    cos = torch.nn.functional.cosine_similarity(decoded.double(), ref.double(), dim=-1)
    assert cos.min() > 0.9999 and torch.equal(decoded.argmax(-1), ref.argmax(-1))


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_fidelity_of_a_full_budget_flow_is_exact_and_a_small_budget_is_not(smollm, tmp_path):
    """quest with every block selected attends like dense: fidelity 1 and equal accuracy; at a
    tight budget the forced pass must see different logits (the metric can fail)."""
    full = evaluate("quest", tasks=["niah_single"], context=512, samples=2, batch=2, params={"budget_ratio": 1.0},
                    max_new_tokens=6, out=tmp_path, llm=smollm)  # a typed value, as Python callers write it
    assert full["fidelity"]["top1"] == 1.0 and full["fidelity"]["top10"] == 1.0
    assert full["fidelity"]["cosine"] > 0.99999
    assert full["accuracy"] == full["dense_accuracy"] and full["relative_accuracy"] in (1.0, None)
    assert "attends every block of the 512-token context" in full["note"]  # said, not silent
    tight = evaluate("quest", tasks=["niah_single"], context=512, samples=2, batch=2, params={"budget": "64"},
                     max_new_tokens=6, out=tmp_path, llm=smollm)
    assert tight["fidelity"]["cosine"] < 0.9999
    assert tight["params"]["budget"] == 64 and tight["fidelity"]["positions"] == full["fidelity"]["positions"]
    assert tight["note"] is None


def test_multiturn_feeds_back_replies(smollm, tmp_path):
    res = evaluate("dense", tasks=["multiturn"], context=768, samples=1, batch=2, max_new_tokens=8, out=tmp_path,
                   llm=smollm)
    [rec] = read_records(tmp_path / os.listdir(tmp_path)[0])
    assert len(rec["output"]) == 3 and len(rec["turn_scores"]) == 3 and len(rec["prompt_tokens"]) == 3
    assert rec["prompt_tokens"][0] < rec["prompt_tokens"][1] < rec["prompt_tokens"][2]
    assert res["tasks"]["multiturn"]["n"] == 1


def test_custom_jsonl(smollm, tmp_path):
    f = tmp_path / "capitals.jsonl"
    f.write_text(
        json.dumps({"prompt": "What is the capital of France? Answer in one word.", "answers": ["Paris"]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "What is the capital of Italy? One word."}],
                      "answers": ["Rome", "Roma"], "metric": "any"}) + "\n"
    )
    res = evaluate("dense", tasks=[str(f)], samples=1, batch=2, max_new_tokens=8, out=tmp_path / "runs", llm=smollm)
    assert res["tasks"]["capitals"]["n"] == 2 and res["tasks"]["capitals"]["total"] == 2  # --samples: generated only
    assert res["tasks"]["capitals"]["accuracy"] == 1.0
    res = evaluate("dense", tasks=[str(f)], limit=1, batch=2, max_new_tokens=8, out=tmp_path / "runs", llm=smollm)
    assert res["tasks"]["capitals"]["n"] == 1 and res["tasks"]["capitals"]["total"] == 2 and res["limit"] == 1


def test_interrupt_leaves_a_partial_record_and_resume_finishes_it(smollm, tmp_path):
    calls = []

    def stop_after_first_chunk(done: float, total: int, what: str) -> None:
        calls.append(done)
        if done >= 1 and done == int(done):  # a whole sample is recorded (fractions come mid-chunk)
            raise KeyboardInterrupt

    kwargs = dict(tasks=["niah_single"], context=256, samples=4, batch=2, max_new_tokens=4, out=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        evaluate("dense", on_progress=stop_after_first_chunk, llm=smollm, **kwargs)
    [run_dir] = list(tmp_path.iterdir())
    partial = json.loads((run_dir / "results.json").read_text())
    assert partial["complete"] is False and TOP_KEYS <= set(partial)
    assert partial["samples_done"] == 2 and partial["samples_total"] == 4
    assert partial["tasks"]["niah_single"]["n"] == 2
    first = read_records(run_dir)
    done = evaluate(resume=run_dir, llm=smollm)
    assert done["complete"] is True and done["samples_done"] == 4
    recs = read_records(run_dir)
    assert recs[:2] == first and sorted(r["index"] for r in recs) == [0, 1, 2, 3]


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_speed_mode_with_random_weights(tmp_path):
    res = evaluate("quest", tasks=None, context=256, batch=2, max_new_tokens=4, mode="speed", random_weights=True,
                   params={"budget": "64"}, out=tmp_path, device="cpu")
    assert res["accuracy"] is None and res["tasks"] == {} and res["complete"]
    sp = res["speed"]
    for side in ("flow", "dense"):
        s = sp[side]
        assert s["batch"] == 2 and s["context"] == 256 and s["gen_tokens"] == 4 and s["preemptions"] == 0
        assert s["decode_steps"] == 3 and s["tpot_ms"]["p50"] > 0 and s["tpot_ms"]["p95"] >= s["tpot_ms"]["p50"]
        assert s["ttft_s"]["p50"] > 0 and s["peak_memory_bytes"] > 0
    assert sp["decode_speedup"] > 0


def test_api_errors(smollm, tmp_path):
    with pytest.raises(SparsetuneError, match="accuracy needs real weights"):
        evaluate("dense", random_weights=True, mode="accuracy", out=tmp_path, device="cpu")
    with pytest.raises(SparsetuneError, match="--mode"):
        evaluate("dense", mode="fast", out=tmp_path, llm=smollm)
    with pytest.raises(SparsetuneError, match="--samples"):
        evaluate("dense", samples=0, out=tmp_path, llm=smollm)
    with pytest.raises(SparsetuneError, match="--resume"):
        evaluate(resume=tmp_path / "nope", llm=smollm)


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_cli_json_and_summary(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "What is the capital of France?", "answers": ["Paris"], "kind": "geo"}) + "\n")
    proc = run("eval", "--task", str(f), "--max-new-tokens", "8", "--out", str(tmp_path / "runs"), "--threads", "1",
               "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert TOP_KEYS <= set(res) and res["complete"] and res["tasks"]["t"]["accuracy"] == 1.0
    assert "t " in proc.stderr and "record:" in proc.stderr  # the summary table goes to stderr with --json
    assert "eval: 1/1 samples" in proc.stderr  # plain progress lines when stderr is not a terminal
    run_dir = tmp_path / "runs" / os.listdir(tmp_path / "runs")[0]
    assert json.loads((run_dir / "env.json").read_text())["torch_threads"] == 1
    assert read_records(run_dir)[0]["meta"]["extra"] == {"kind": "geo"}  # a dataset's own field, kept


def test_cli_list_tasks():
    proc = run("eval", "--list-tasks", "--json")
    assert proc.returncode == 0
    out = json.loads(proc.stdout)
    names = {t["name"] for t in out["tasks"]}
    assert {"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "multiturn"} <= names
    assert set(out["default_suite"]) <= names


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--task", "nosuch"), ("unknown task", "niah_single")),
        (("--flow", "nosuch"), ("unknown flow",)),
        (("--context", "8"), ("--context",)),
        (("--random-weights", "--mode", "accuracy"), ("accuracy needs real weights",)),
    ],
)
def test_cli_errors(tmp_path, args, needles):
    assert_clean_error(run("eval", "--out", str(tmp_path), *args), *needles)


def test_cli_broken_jsonl_names_line_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "answers": ["x"]}) + "\n" + json.dumps({"prompt": "hi", "answers": "x"}) + "\n")
    assert_clean_error(run("eval", "--task", str(f), "--out", str(tmp_path)), "bad.jsonl:2", "answers")


@pytest.mark.slow  # >= 10 s on 2 CPU cores
def test_cli_interrupt_keeps_partial_run(tmp_path):
    """SIGINT mid-run: exit 130, results.json marked incomplete, no traceback."""
    import signal
    import time

    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsetune.cli.main", "eval", "--task", "niah_single", "--context", "256",
         "--samples", "40", "--batch", "1", "--max-new-tokens", "4", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default,
    )
    deadline = time.time() + 300
    while time.time() < deadline:  # wait for the first finished sample
        runs = list(out.glob("*/samples.jsonl"))
        if runs and runs[0].read_text().count("\n") >= 1:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    [run_dir] = list(out.iterdir())
    assert "Traceback" not in stderr and f"sparsetune eval --resume {run_dir}" in stderr
    res = json.loads((run_dir / "results.json").read_text())
    assert res["complete"] is False and 1 <= res["samples_done"] < 40


def test_interrupt_mid_pass_leaves_the_engine_idle(smollm, tmp_path, monkeypatch):
    """Ctrl-C while a pass still has requests in flight (here in the dense pass of a flow's eval, at
    its second engine step): the interrupt propagates as itself, not as the flow switch that follows
    it, and the engine is idle, so the next eval (or a restored flow) runs."""
    step, calls = smollm.engine.step, []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(smollm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        evaluate("quest", llm=smollm, tasks=["niah_single"], context=256, samples=2, batch=2, max_new_tokens=4,
                 out=tmp_path)
    assert not smollm.engine.scheduler.has_work()


def test_the_budget_note_names_a_window_that_covers_the_context(smollm):
    """A flow whose indexer scores nothing (streaming: sinks + local window) is told apart by its
    traced stages, and said to be dense when its window covers the context."""
    from sparsetune.evaluation.runner import _budget_note

    try:
        smollm.apply(smollm.setup.with_flow("streaming", {"local_blocks": "40", "dense_layers": ""}))  # 1 + 40 blocks of 16 > 512 tokens
        note = _budget_note(smollm, 512)
        assert note and "its sink and local blocks (1 + 40)" in note and "lower --param local_blocks" in note
        assert _budget_note(smollm, 4096) is None
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "64"}))
        assert _budget_note(smollm, 512) is None
        smollm.apply(smollm.setup.with_flow("quest", {"budget": "512"}))
        assert "its budget (512 tokens)" in _budget_note(smollm, 500)
    finally:
        smollm.apply(smollm.setup.with_flow(None))
