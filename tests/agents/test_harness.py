"""The candidate harness: static refusals on the syntax tree, `flows check` semantics in a
sandboxed subprocess (a hang and an unbounded allocation are killed), the record of each stage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparsetune.agents.harness import Candidate, load_candidates, validate
from sparsetune.agents.sandbox import Limits, clean_env, run_limited
from helpers import FLOW_HEAD, GOOD_INDEX, candidate_flow

LIMITS = Limits(wall_s=60, memory_mb=1500, cpu_s=120)

HEAD, GOOD, flow = FLOW_HEAD, GOOD_INDEX, candidate_flow


def run(tmp_path: Path, source: str, limits: Limits = LIMITS) -> Candidate:
    return validate(Candidate("0001", "cand", "test", source), tmp_path / "candidates", limits)


@pytest.mark.parametrize("source,needle", [
    (flow(GOOD).replace("def index(self, q, fields):", "def index(self, q, fields)"), "syntax error"),
    (flow(GOOD, head=HEAD + "import os\n"), "`import os` is not allowed"),
    (flow("x = open('/etc/passwd')\n" + GOOD), "`open` is not allowed"),
    (flow("m = __import__('os')\n" + GOOD), "`__import__` is not allowed"),
    # a global of the harness: the check module, or the op module's tracer
    (flow(GOOD, head=HEAD + "from sparsetune.flow import check\n"), "`from sparsetune.flow import check` is not allowed"),
    (flow(GOOD, head=HEAD + "from sparsetune.flow.ops import active\n"), "`from sparsetune.flow.ops import active`"),
    (flow("t = F.trace.active()\n" + GOOD), "is not a flow op"),
    (flow("g = self.index.__globals__\n" + GOOD), "`.__globals__` is not allowed"),
    (flow(GOOD, head=HEAD + "import torch\n").replace("F.mean(k, dim=1)", "torch.mean(k, 1)"), "`torch` is not allowed in a flow stage"),
])
def test_static_refusals_name_the_line(tmp_path, source, needle):
    cand = run(tmp_path, source)
    assert cand.verdict == "rejected at static"
    assert needle in cand.reason, cand.reason
    assert [s.name for s in cand.stages] == ["static"]  # nothing of it ran
    saved = json.loads((tmp_path / "candidates" / "0001" / "candidate.json").read_text())
    assert saved["verdict"] == "rejected at static" and saved["reason"] == cand.reason
    assert (tmp_path / "candidates" / "0001" / "cand.py").read_text() == source


def test_valid_flow_passes_with_its_cost(tmp_path):
    cand = run(tmp_path, flow(GOOD))
    assert cand.verdict == "accepted", cand.reason
    report = cand.stages[-1].detail["report"]
    assert report["fields"] == {"centroid": [1, 64]} and report["field_bytes_per_block"] == 2 * 64
    assert report["full_budget_rel_err"] < 1e-5
    [loaded] = load_candidates(tmp_path / "candidates")
    assert loaded.verdict == "accepted" and loaded.stages[-1].detail["report"]["fields"] == report["fields"]


def test_shape_error_is_rejected_with_the_line(tmp_path):
    cand = run(tmp_path, flow('return F.topk(F.gemm(fields["centroid"], q))'))
    assert cand.verdict == "rejected at check"
    assert cand.reason.endswith("cand.py:12: F.topk needs a score of shape [S, 1, 1], got [4, 1, 4]; reduce the inner axes first")


def test_raw_keys_pass_and_cost_their_bytes(tmp_path):
    """A field that stores the keys themselves is valid; its bytes (every key) count in speed."""
    cand = run(tmp_path, flow('return F.topk(F.max(F.max(F.gemm(fields["keys"], q), dim=1), dim=2))',
                              cache='return {"keys": F.scale(k)}'))
    assert cand.verdict == "accepted", cand.reason
    report = cand.stages[-1].detail["report"]
    assert report["field_bytes_per_block"] == 2 * 16 * 64  # block 16 x head dim 64: the keys' own bytes


def test_constant_score_passes_the_checks(tmp_path):
    """A constant score is a valid program (it equals dense at full budget); the accuracy gate scores it."""
    cand = run(tmp_path, flow('return F.topk(F.fill(F.max(F.gemm(fields["centroid"], q), dim=2), 1.0))'))
    assert cand.verdict == "accepted", cand.reason


def test_a_hang_is_killed(tmp_path):
    cand = run(tmp_path, flow("s = F.gemm(fields['centroid'], q)\nwhile True:\n    s = F.add(s, s)\n" + GOOD),
               Limits(wall_s=20, memory_mb=3000, cpu_s=120))
    assert cand.verdict == "rejected at check"
    assert cand.reason == "killed by the harness: over its wall-clock limit of 20 s"
    log = Path(cand.stages[-1].detail["log"])
    assert log.is_file()


def test_unbounded_allocation_is_killed(tmp_path):
    cand = run(tmp_path, flow("keep = [[q] * 10 ** 7 for i in range(10 ** 6)]\n" + GOOD),
               Limits(wall_s=120, memory_mb=1200, cpu_s=120))
    assert cand.verdict == "rejected at check"
    # the watchdog's memory limit, or the address-space limit under it: either way, memory
    assert "memory" in cand.reason.lower(), cand.reason
    assert cand.stages[-1].seconds < 100


def test_children_get_no_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("SOME_TOKEN", "t")
    monkeypatch.setenv("SPARSETUNE_PLAIN", "kept")
    assert not {"ANTHROPIC_API_KEY", "OPENAI_API_KEY", "SOME_TOKEN"} & set(clean_env(Limits()))
    out = tmp_path / "env.json"
    code = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    res = run_limited([sys.executable, "-c", code], Limits(wall_s=30), tmp_path / "env.log", out)
    assert res.result is not None and res.killed is None
    assert "ANTHROPIC_API_KEY" not in res.result and "SOME_TOKEN" not in res.result
    assert res.result["SPARSETUNE_PLAIN"] == "kept" and res.result["CUDA_VISIBLE_DEVICES"] == ""
    assert res.result["MALLOC_ARENA_MAX"] == "2"  # else RLIMIT_AS fails torch's threads on a many-core host


def test_the_address_space_cap_counts_from_what_the_imports_mapped(tmp_path):
    """A CUDA build of torch maps GB of libraries with no GPU visible: the cap is set after the imports,
    on top of what they mapped, and still stops an allocation past `memory_mb`."""
    out = tmp_path / "as.json"
    code = f"""import json, mmap
from sparsetune.agents.sandbox import cap_address_space
libs = mmap.mmap(-1, 6 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=0)  # PROT_NONE
cap_address_space()
fits = bytearray(256 << 20)
try:
    bytearray(2 << 30)
    over = "allocated"
except MemoryError:
    over = "MemoryError"
json.dump({{"over": over}}, open({str(out)!r}, "w"))
"""
    res = run_limited([sys.executable, "-c", code], Limits(wall_s=60, memory_mb=1024), tmp_path / "as.log", out)
    assert res.killed is None and res.result == {"over": "MemoryError"}, res.reason()


def test_a_child_that_writes_nothing_says_why(tmp_path):
    res = run_limited([sys.executable, "-c", "raise SystemExit('boom')"], Limits(wall_s=30), tmp_path / "x.log",
                      tmp_path / "x.json")
    assert res.result is None and res.reason() == "the sandbox exited with code 1: boom"
