"""`sparsetune flows promote`: a candidate that passed the harness becomes a flow file of the
user's, under a header naming its origin and figures; one that did not is refused."""

from __future__ import annotations

import json

import pytest

from helpers import assert_clean_error, candidate_flow, run
from sparsetune import api
from sparsetune.agents.harness import Candidate, Stage
from sparsetune.errors import SparsetuneError
from sparsetune.loader import get_flow_class


def run_dir(tmp_path, stages):
    root = tmp_path / "runs" / "s"
    cand = Candidate("0003", "cand_p", "evolve", candidate_flow(name="cand_p"), ["quest"], "centroids, max over heads",
                     stages=stages)
    cand.save(root / "candidates")
    point = {"flow": "cand_p", "number": 2, "state": "COMPLETE", "stage": "full", "role": "search",
             "params": {"block_size": "8", "budget_ratio": "0.25"},
             "accuracy": {"relative_accuracy": 0.97}, "speed": {"speedup": 1.31, "kv_share": 0.3}}
    (root / "trials.jsonl").write_text(json.dumps(point) + "\n")
    (root / "frontier.json").write_text(json.dumps({"confirmed_frontier": [
        {"trial": "cand_p#2", "flow": "cand_p", "params": point["params"], "confirmed_accuracy": 0.99,
         "interval": [0.8, 1.0], "speedup": 1.31, "speed_kind": "measured"}]}))
    (root / "search.json").write_text(json.dumps({"search": {"study": "s", "model": "smollm2-135m", "context": 2048,
                                                             "min_accuracy": 0.95}}))
    return root / "candidates" / "0003"


PASSED = [Stage("static", True, None, 0.01), Stage("check", True, None, 6.0), Stage("gate", True, None, 9.0)]


def test_a_passed_candidate_becomes_a_flow_file_with_its_origin_and_figures(tmp_path):
    folder = run_dir(tmp_path, PASSED)
    out = tmp_path / "mine.py"
    res = api.promote_flow(folder, out)
    text = out.read_text()
    assert res["file"] == str(out) and text.endswith(candidate_flow(name="cand_p"))
    header = text.split("\n\n")[0]
    assert "search 's'" in header and "candidate 0003 by evolve; parents: quest" in header
    assert "rationale: centroids, max over heads" in header
    assert "97.0% of dense, speedup 1.31x, K/V read 0.3" in header
    assert "confirmed frontier: cand_p#2" in header and "99.0% of dense on fresh prompts [0.8, 1.0]" in header
    assert get_flow_class(str(out)).name == "cand_p"  # the header is comments: the file loads as before
    with pytest.raises(SparsetuneError, match="exists; pick another --out"):
        api.promote_flow(folder, out)


def test_a_rejected_candidate_is_refused(tmp_path):
    folder = run_dir(tmp_path, [Stage("static", True, None, 0.01), Stage("check", False, "F.topk needs a score", 6.0)])
    proc = run("flows", "promote", str(folder), "--out", str(tmp_path / "x.py"))
    assert proc.returncode == 2
    assert_clean_error(proc, "candidate 0003 (cand_p) was rejected at check: F.topk needs a score")
    assert not (tmp_path / "x.py").exists()


def test_a_hostile_rationale_stays_in_its_comment_and_the_source_is_the_validated_bytes(tmp_path):
    """Every line of a rationale after the first became code in the promoted file (issue #40)."""
    import ast

    folder = run_dir(tmp_path, PASSED)
    data = json.loads((folder / "candidate.json").read_text())
    marker = tmp_path / "MARKER"
    data["rationale"] = (f"fine\nimport os; os.system('touch {marker}')\rX = 1\u2028Y = 2\x0bZ = 3\x0c"
                         f"W = 4\x1cV = 5\x85U = 6\u2029T = 7")
    (folder / "candidate.json").write_text(json.dumps(data))
    out = tmp_path / "mine.py"
    api.promote_flow(folder, out)
    text = out.read_bytes()
    source = (folder / "cand_p.py").read_bytes()
    assert text.endswith(b"\n" + source)
    header = text[: len(text) - len(source)].decode()
    assert all(line.startswith("# ") for line in header.splitlines()[:-1]) and header.splitlines()[-1] == ""
    assert ast.dump(ast.parse(text)) == ast.dump(ast.parse(source))  # the header adds no code at all
    assert not marker.exists()


def test_a_candidate_whose_file_changed_after_the_harness_is_refused(tmp_path):
    folder = run_dir(tmp_path, PASSED)
    (folder / "cand_p.py").write_text((folder / "cand_p.py").read_text() + "\nX = 1\n")
    with pytest.raises(SparsetuneError, match="is not the source the harness validated"):
        api.promote_flow(folder, tmp_path / "mine.py")
    data = json.loads((folder / "candidate.json").read_text())
    data["name"] = "../../evil"
    (folder / "candidate.json").write_text(json.dumps(data))
    with pytest.raises(SparsetuneError, match="not a Python identifier"):
        api.promote_flow(folder, tmp_path / "mine2.py")
