"""`search --agent`: proposals (from the claude proposer, through the Anthropic SDK's own transport
hook, scripted) go through the harness inside a real search on the embedded model; every rejection
is recorded with its reason, a hang is killed and the search goes on, accepted flows get studies
and trials like the built-in ones, the cost cap stops proposing, and a resumed search keeps them."""

from __future__ import annotations

import json

import httpx2
import pytest

from helpers import CLAUDE_MODEL, FLOW_HEAD, GOOD_INDEX, candidate_flow, claude_client, claude_message
from sparsetune import api
from sparsetune.agents.llm import ClaudeProposer, canonical_hash, cost_usd
from sparsetune.agents.loop import Agent
from sparsetune.agents.sandbox import Limits
from sparsetune.tuning.config import SearchConfig

CASES = [  # (source, verdict, a phrase of the reason)
    (candidate_flow(name="c_syntax").replace("def index(self, q, fields):", "def index(self, q, fields)"),
     "rejected at static", "syntax error"),
    (candidate_flow(name="c_os", head=FLOW_HEAD + "import os\n"), "rejected at static", "`import os` is not allowed"),
    (candidate_flow("x = open('/etc/passwd')\n" + GOOD_INDEX, name="c_open"), "rejected at static", "`open` is not allowed"),
    (candidate_flow("m = __import__('os')\n" + GOOD_INDEX, name="c_import"), "rejected at static", "`__import__` is not allowed"),
    (candidate_flow(name="c_global", head=FLOW_HEAD + "from sparsetune.flow import check\n"), "rejected at static",
     "`from sparsetune.flow import check` is not allowed"),
    (candidate_flow('return F.topk(F.gemm(fields["centroid"], q))', name="c_shape"), "rejected at check",
     "F.topk needs a score of shape [S, 1, 1]"),
    (candidate_flow("s = F.gemm(fields['centroid'], q)\nwhile True:\n    s = F.add(s, s)\n" + GOOD_INDEX, name="c_hang"),
     "rejected at check", "killed by the harness: over its wall-clock limit"),
    (candidate_flow(name="quest"), "rejected at static", "the flow name 'quest' is taken"),
    (candidate_flow('return F.topk(F.fill(F.max(F.gemm(fields["centroid"], q), dim=2), 1.0))', name="c_constant"),
     "accepted", None),
    (candidate_flow('return F.topk(F.max(F.max(F.gemm(fields["keys"], q), dim=1), dim=2))',
                    cache='return {"keys": F.scale(k)}', name="c_keys"), "accepted", None),
    (candidate_flow(name="c_good"), "accepted", None),
]


FIRST = {"input_tokens": 1000, "output_tokens": 500, "cache_creation_input_tokens": 4000, "cache_read_input_tokens": 0}
LATER = {**FIRST, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4000}


class Script:
    """The Messages API as a mock transport: each request is answered with the next case's file."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(json.loads(request.content))
        i = len(self.requests) - 1
        return httpx2.Response(200, json=claude_message({"source": CASES[i][0], "rationale": f"case {i}"},
                                                        usage=FIRST if i == 0 else LATER))


@pytest.mark.slow  # a search on the embedded model: about three minutes on 2 CPU cores
def test_agent_search_records_every_verdict_and_searches_what_passed(tmp_path, monkeypatch):
    # the budget: every case's call, and not one more (the first writes the cached prefix, the rest read it)
    spent = [cost_usd(CLAUDE_MODEL, FIRST if i == 0 else LATER) for i in range(len(CASES))]
    options = dict(tasks=("niah_single",), context=256, samples=1, confirm_samples=1, batch=4, params={"block_size": "16"},
                   study="ag", out=str(tmp_path), device="cpu", agent="claude", agent_budget_usd=sum(spent) - 1e-4)
    script = Script()
    proposer = ClaudeProposer(CLAUDE_MODEL, client=claude_client(script))

    def agent(cfg: SearchConfig, _proposer) -> Agent:  # a short check limit for the hang, a proposal every trial
        return Agent(cfg, proposer, check_limits=Limits(wall_s=15, memory_mb=3072, cpu_s=60), propose_every=1,
                     rejects_in_a_row=len(CASES))

    monkeypatch.setattr("sparsetune.agents.loop.Agent", agent)
    monkeypatch.setattr("sparsetune.agents.loop.make_proposer", lambda cfg: proposer)
    result = api.search("quest,block_topk", trials=8, **options)

    cands = result["candidates"]
    got = {r["name"]: (r["verdict"], r["reason"]) for r in cands["candidates"]}
    assert len(cands["candidates"]) == len(CASES)
    for (source, verdict, phrase), row in zip(CASES, cands["candidates"]):
        assert row["verdict"] == verdict, (row["name"], row["reason"])
        if phrase is not None:
            assert phrase in row["reason"], (row["name"], row["reason"])
    assert cands["accepted"] == 3 and cands["share_valid"] == round(3 / len(CASES), 4)
    assert len(script.requests) == len(CASES)  # the cap stopped the loop: no call past it
    assert cands["cost_usd"] == pytest.approx(sum(spent))
    assert cands["stopped"].startswith("--agent-budget-usd")
    assert all(r["system"][0]["cache_control"] == {"type": "ephemeral"} for r in script.requests)
    assert 0 < cands["diversity"]["mean_distance"] <= 1
    assert cands["versus_builtins"] is None  # no --min-accuracy: no bar to hold the speed at

    records = [json.loads(line) for line in (tmp_path / "ag" / "trials.jsonl").read_text().splitlines()]
    by_flow = {}
    for r in records:
        by_flow.setdefault(r["flow"], []).append(r)
    assert {"c_constant", "c_keys", "c_good"} <= set(by_flow)  # each accepted flow has a study with trials
    assert not {"c_syntax", "c_shape", "c_hang", "c_os"} & set(by_flow)
    # scored honestly: the raw keys cost their bytes, so at the same point it is slower than a centroid
    keys, good = by_flow["c_keys"][0], by_flow["c_good"][0]
    assert keys["params"] == good["params"] and keys["speed"]["kv_share"] == good["speed"]["kv_share"]
    assert keys["speed"]["speedup"] < good["speed"]["speedup"]
    assert keys["role"] == "start"  # a candidate's defaults are where its study starts, not a baseline
    assert {r["role"] for r in result["defaults"]} == {"defaults"} and {r["flow"] for r in result["defaults"]} == {
        "quest", "block_topk"}
    # each record on disk: source, proposer, parents, rationale, tokens and cost, the stages with timings
    folder = tmp_path / "ag" / "candidates" / "0010"
    saved = json.loads((folder / "candidate.json").read_text())
    assert (folder / "c_good.py").read_text() == CASES[-1][0]
    assert saved["proposer"] == "claude" and saved["rationale"] == "case 10"
    assert saved["usage"] == LATER and saved["cost_usd"] == pytest.approx(spent[-1])
    assert saved["prompt_hash"] == canonical_hash(script.requests[-1])
    assert [s["name"] for s in saved["stages"]] == ["static", "check", "gate"]
    gate = saved["stages"][2]["detail"]
    assert gate["seed"] == 5010 and gate["relative_accuracy"] is not None
    # the model was shown the verdicts so far: the last request names the hang's reason
    assert "killed by the harness" in script.requests[-1]["messages"][0]["content"]

    shown = api.search_show(tmp_path / "ag")
    assert [r["name"] for r in shown["candidates"]["candidates"]] == [r["name"] for r in cands["candidates"]]

    # resumed: the accepted flows' studies are back in the search, nothing is proposed twice
    again = api.search("quest,block_topk", trials=10, **options)
    assert len(again["candidates"]["candidates"]) == len(CASES) and len(script.requests) == len(CASES)
    records = [json.loads(line) for line in (tmp_path / "ag" / "trials.jsonl").read_text().splitlines()]
    assert len(records) >= 10 and {"c_constant", "c_keys", "c_good"} <= {r["flow"] for r in records}
    assert got == {r["name"]: (r["verdict"], r["reason"]) for r in again["candidates"]["candidates"]}


def _rec(flow, number, speedup, confirmed=None, holds=True):
    return {"flow": flow, "number": number, "params": {"budget_ratio": "0.1"}, "speed": {"speedup": speedup},
            "confirm": None if confirmed is None else {"relative_accuracy": confirmed, "holds": holds}}


def test_a_proposal_beats_the_built_ins_only_where_it_held_the_bar_on_fresh_prompts_and_ran_faster():
    """Item 5 of #43: the report says whether any proposal beats the best tuned built-in on fresh
    prompts: the built-ins' fastest point that held the bar, against proposed points that held it too."""
    from sparsetune.agents.loop import versus_builtins

    records = [_rec("block_topk", 0, 2.4, 0.60), _rec("block_topk", 3, 1.9, 0.97),  # the best built-in at 0.95
               _rec("quest", 2, 2.2, 0.96, holds=False),  # did not hold: not the best
               _rec("block_topk_2l", 1, 1.7, 0.99),
               _rec("evo_a", 0, 2.3, 0.96), _rec("evo_a", 1, 2.8, 0.90),  # faster and held / below the bar
               _rec("evo_b", 0, 1.8, 0.99),  # held, slower
               _rec("evo_c", 0, 3.0), _rec("evo_d", 0, 2.6, 0.98, holds=False)]  # never confirmed / did not hold
    v = versus_builtins(records, {"evo_a", "evo_b", "evo_c", "evo_d"}, 0.95)
    assert v["best_builtin"]["trial"] == "block_topk#3" and v["best_builtin"]["speedup"] == 1.9
    assert [f["trial"] for f in v["beaten_by"]] == ["evo_a#0"]
    assert v["line"].startswith("1 proposed point(s) beat the built-ins at 95% of dense on fresh prompts: the fastest, evo_a#0")
    slower = versus_builtins([r for r in records if r["flow"] != "evo_a"], {"evo_b", "evo_c", "evo_d"}, 0.95)
    assert slower["beaten_by"] == [] and slower["line"] == (
        "no proposal beats the built-ins at 95% of dense on fresh prompts (the best tuned built-in, block_topk#3: 97% at 1.90×)")
    alone = versus_builtins([_rec("evo_b", 0, 1.8, 0.99)], {"evo_b"}, 0.95)  # no built-in held the bar
    assert alone["best_builtin"] is None and [f["trial"] for f in alone["beaten_by"]] == ["evo_b#0"]
    assert versus_builtins(records, {"evo_a"}, None) is None
    crashed = {**_rec("quest", 5, 2.9), "confirm": {"holds": False, "error": "OutOfMemoryError: CUDA out of memory"}}
    assert versus_builtins(records + [crashed], {"evo_a"}, 0.95)["line"].endswith(
        "(the best tuned built-in, block_topk#3: 97% at 1.90×; 1 of their points could not be confirmed)")
