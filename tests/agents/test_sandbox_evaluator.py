"""The search's evaluator in a sandboxed child: a trial there gives the figures the same trial gives
in-process; a request past its limit, or a child past its memory, is killed and the next request
starts a fresh child."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsetune.agents.sandbox import Limits, SandboxError, SandboxEvaluator
from sparsetune.tuning.config import SearchConfig
from sparsetune.tuning.cascade import run_trial
from sparsetune.tuning.trial import EngineEvaluator

SMALL = dict(model="smollm2-135m", tasks=("niah_single",), context=256, samples=1, batch=4, confirm_samples=1)


@pytest.mark.slow  # two engines on 2 CPU cores
def test_a_sandboxed_trial_matches_the_same_trial_in_process(tmp_path):
    cfg = SearchConfig(study="s", out=str(tmp_path), flows=("block_topk",), trials=1, device="cpu", **SMALL)
    params = {"block_size": "4", "budget_ratio": "0.25"}
    box = SandboxEvaluator(cfg, tmp_path / "sandbox", Limits(wall_s=600, memory_mb=6000, cpu_only=True))
    try:
        there = box.run_trial(cfg, None, "block_topk", params, tmp_path / "t1")
        acc = box.accuracy("block_topk", params, samples=1, seed=0, out=tmp_path / "a1")
    finally:
        box.close()
    here = run_trial(cfg, EngineEvaluator(cfg), "block_topk", params, tmp_path / "t2")
    assert there["stage"] == here["stage"] == "full"
    assert there["accuracy"]["relative_accuracy"] == here["accuracy"]["relative_accuracy"] == acc.relative
    assert there["accuracy"]["fidelity"] == here["accuracy"]["fidelity"] == acc.fidelity
    assert there["speed"]["speedup"] == here["speed"]["speedup"]
    assert box.starts == 1  # one child served both
    # the child wrote in its scratch folder; its outputs were copied to the `out` asked for, paths rewritten
    run_dir = Path(there["accuracy"]["run_dir"])
    assert run_dir.parent == tmp_path / "t1" and json.loads((run_dir / "results.json").read_text())["run_dir"] == str(run_dir)
    assert Path(acc.run_dir).parent == tmp_path / "a1" and (Path(acc.run_dir) / "results.json").is_file()
    assert not any((tmp_path / "sandbox" / "scratch" / "out").iterdir())


def test_a_request_past_its_limit_is_killed_and_the_next_starts_afresh(tmp_path):
    cfg = SearchConfig(study="s", out=str(tmp_path), flows=("block_topk",), trials=1, device="cpu", **SMALL)
    box = SandboxEvaluator(cfg, tmp_path / "sandbox", Limits(wall_s=1, memory_mb=6000, cpu_only=True))
    with pytest.raises(SandboxError, match=r"killed by the harness: trial of block_topk took over 1 s"):
        box.run_trial(cfg, None, "block_topk", {}, tmp_path / "t")  # loading the engine alone takes longer
    assert box._proc is None
    box.limits = Limits(wall_s=120, memory_mb=200, cpu_only=True)  # torch alone is more
    with pytest.raises(SandboxError, match=r"over its memory limit of 200 MB"):
        box.accuracy("block_topk", {}, samples=1, seed=0, out=tmp_path / "a")
    assert box.starts == 2


class _Child:
    """A child that has answered already (its answer queued): what the parent does with an answer."""

    def __init__(self) -> None:
        import io

        self.stdin = io.BytesIO()

    def poll(self):
        return None


def test_the_childs_events_are_relayed_as_the_searchs_and_nothing_else_of_them(tmp_path, monkeypatch):
    import queue
    from types import SimpleNamespace

    monkeypatch.setenv("SPARSETUNE_TEST_TOKEN", "sk-ant-api03-" + "x" * 40)
    cfg = SearchConfig(study="s", out=str(tmp_path), flows=("block_topk",), trials=1, device="cpu", **SMALL)
    box = SandboxEvaluator(cfg, tmp_path / "sandbox", Limits(wall_s=60, memory_mb=6000, cpu_only=True))
    got = []
    box.emit = lambda kind, data: got.append((kind, data))
    box._box = SimpleNamespace(proc=_Child())
    box._answers = queue.Queue()
    forged = [
        {"kind": "begin", "data": {"study": "../../etc"}},  # not a kind the child may send
        {"kind": "turns", "data": "not a dict"}, "not an event", ["nor", "this"],
        {"kind": "turns", "data": {"reason": "CUDA out of memory [bold]\x1b]0;title\x1b\\\x1b[2J\nforged line " + "y" * 900,
                                   "extra": "dropped"}},
        *[{"kind": "turns", "data": {"reason": f"flood {i}"}} for i in range(1000)],  # one of a kind an answer
    ]
    box._answers.put({"ok": False, "error": "OutOfMemory: again", "events": forged})
    with pytest.raises(SandboxError, match="OutOfMemory: again"):  # a failed request's events still come through
        box.request({"op": "trial", "flow": "block_topk", "params": {}})
    assert [k for k, _ in got] == ["turns"]
    reason = got[0][1]["reason"]
    assert set(got[0][1]) == {"reason"} and reason.startswith("CUDA out of memory [bold] ]0;title") and len(reason) == 500
    assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in reason)  # no escape, no newline: one printable line
    secret = "sk-ant-api03-" + "x" * 40  # scrubbed before it is cut: a secret across the cut leaves no prefix
    box._answers.put({"ok": True, "record": {"x": 1}, "events": [{"kind": "turns", "data": {"reason": "y" * 480 + secret}}]})
    assert box.request({"op": "trial", "flow": "block_topk", "params": {}}) == {"ok": True, "record": {"x": 1}}
    assert "sk-ant" not in got[1][1]["reason"] and got[1][1]["reason"].startswith("y" * 480 + "[redacted]")
    box._answers.put({"ok": True, "record": {"x": 1}, "events": "not a list"})  # ignored, the answer kept
    assert box.request({"op": "trial", "flow": "block_topk", "params": {}}) == {"ok": True, "record": {"x": 1}}
    assert len(got) == 2
