"""The LLM proposers (`agents.llm`): what they send and how they read the answer, through the HTTP
clients' own mock transports (the Anthropic SDK's httpx2 client, and httpx2 for the
OpenAI-compatible endpoint); no network. Then their proposals through the real harness."""

from __future__ import annotations

import hashlib
import json

import anthropic
import httpx2
import pytest

from helpers import CLAUDE_MODEL as MODEL
from helpers import CLAUDE_USAGE as USAGE
from helpers import FLOW_HEAD, GOOD_INDEX, candidate_flow, claude_client, claude_message
from sparsetune.agents.harness import Candidate, Stage, declared_name, validate
from sparsetune.agents.llm import (CACHE_READ, CACHE_WRITE, PRICES, TOOL_NAME, TOOL_SCHEMA, ClaudeProposer,
                                   OpenAIProposer, cost_usd, round_message, static_prefix, usage_dict)
from sparsetune.agents.proposer import Context
from sparsetune.errors import SparsetuneError
from sparsetune.flow.ops import OPS
from sparsetune.loader import flow_path



def context(round_: int = 3) -> Context:
    """A search in progress: a frontier and a few candidates, one of each verdict."""
    good = Candidate("0000", "cand_a", "claude", candidate_flow(name="cand_a"), rationale="mean keys, max over heads",
                     stages=[Stage("static", True, None, 0.01),
                             Stage("check", True, None, 5.0, {"report": {"fields": {"centroid": [1, 64]},
                                                                         "field_bytes_per_block": 128,
                                                                         "indexer_flops_per_block": 512}}),
                             Stage("gate", True, None, 9.0, {"relative_accuracy": 0.97, "bar": 0.5})])
    bad = Candidate("0001", "cand_b", "claude", "import os\n", rationale="read a file",
                    stages=[Stage("static", False, "cand_b.py:1: `import os` is not allowed in a flow file; " + "x" * 600,
                                  0.01)])
    frontier = [{"flow": "cand_a", "trial": "cand_a/3", "params": {"budget_ratio": 0.0625}, "relative_accuracy": 0.981,
                 "speedup": 2.3456, "kv_share": 0.125},
                {"flow": "quest", "trial": "quest/1", "params": {"budget_ratio": 0.25}, "relative_accuracy": 1.0,
                 "speedup": 1.5, "kv_share": 0.3}]
    return Context(round_, "keep accuracy, read fewer bytes", frontier, [good, bad])


# ---- Claude, through the SDK's own transport -----------------------------------------------------


class Recorder:
    """A mock transport handler: answers each request with the next scripted response, keeps the requests."""

    def __init__(self, *responses: httpx2.Response) -> None:
        self.responses, self.requests = list(responses), []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        return self.responses.pop(0) if len(self.responses) > 1 else self.responses[0]

    def body(self, i: int = -1) -> dict:
        return json.loads(self.requests[i].content)


def test_claude_sends_the_cached_prefix_and_forces_the_tool():
    source = candidate_flow(name="cand_c")
    rec = Recorder(httpx2.Response(200, json=claude_message({"source": source, "rationale": "centroids, cheaper"})))
    ctx = context()
    p = ClaudeProposer(MODEL, client=claude_client(rec)).propose(ctx)

    [req] = rec.requests
    assert req.method == "POST" and req.url.path == "/v1/messages"
    body = rec.body()
    assert body["model"] == MODEL and body["max_tokens"] > 0
    assert body["system"] == [{"type": "text", "text": static_prefix(), "cache_control": {"type": "ephemeral"}}]
    assert body["tool_choice"] == {"type": "tool", "name": TOOL_NAME}
    assert body["tools"] == [{"name": TOOL_NAME, "description": body["tools"][0]["description"], "input_schema": TOOL_SCHEMA}]
    assert TOOL_SCHEMA["required"] == ["source", "rationale"]
    assert body["messages"] == [{"role": "user", "content": round_message(ctx)}]
    assert not {"temperature", "top_p", "top_k"} & set(body)

    assert (p.source, p.rationale, p.proposer, p.parents) == (source, "centroids, cheaper", "claude", [])
    assert p.usage == USAGE
    p_in, p_out = PRICES[MODEL]
    by_hand = (1234 * p_in + 4000 * 1.25 * p_in + 8000 * 0.1 * p_in + 567 * p_out) / 1e6
    assert p.cost_usd == pytest.approx(by_hand, rel=1e-12) and (CACHE_WRITE, CACHE_READ) == (1.25, 0.1)
    # the hash is of the body that went over the wire, as canonical JSON
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert p.prompt_hash == hashlib.sha256(canonical.encode()).hexdigest()


def test_claude_prompt_hash_follows_the_context():
    rec = Recorder(httpx2.Response(200, json=claude_message({"source": "x", "rationale": "y"})))
    proposer = ClaudeProposer(MODEL, client=claude_client(rec))
    a, b = proposer.propose(context()), proposer.propose(context())
    assert a.prompt_hash == b.prompt_hash and rec.body(0) == rec.body(1)
    ctx = context()
    ctx.frontier[0]["speedup"] = 2.9
    c = proposer.propose(ctx)
    assert c.prompt_hash != a.prompt_hash and "2.9" in rec.body(2)["messages"][0]["content"]
    assert proposer.propose(context(round_=4)).prompt_hash != a.prompt_hash


def test_claude_reply_without_the_tool_call_is_an_empty_source():
    rec = Recorder(httpx2.Response(200, json=claude_message(None, text="Here is my idea: use centroids.")))
    p = ClaudeProposer(MODEL, client=claude_client(rec)).propose(context())
    assert p.source == ""
    assert "without the propose_flow tool call" in p.rationale and "use centroids" in p.rationale
    assert p.usage == USAGE and p.cost_usd > 0  # the call was paid for all the same


def test_claude_tool_call_without_a_string_source_is_an_empty_source():
    rec = Recorder(httpx2.Response(200, json=claude_message({"source": 3, "rationale": "y"})))
    p = ClaudeProposer(MODEL, client=claude_client(rec)).propose(context())
    assert p.source == "" and "without a string `source`" in p.rationale


def test_claude_reply_cut_at_max_tokens_is_an_empty_source():
    cut = {**claude_message({"source": "class Cand(", "rationale": "y"}), "stop_reason": "max_tokens"}
    p = ClaudeProposer(MODEL, client=claude_client(Recorder(httpx2.Response(200, json=cut))), max_tokens=64).propose(context())
    assert p.source == "" and "cut at max_tokens=64" in p.rationale and p.usage == USAGE


def test_claude_bad_key_names_the_variable():
    err = {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}
    rec = Recorder(httpx2.Response(401, json=err))
    with pytest.raises(SparsetuneError) as e:
        ClaudeProposer(MODEL, client=claude_client(rec)).propose(context())
    msg = str(e.value)
    assert "ANTHROPIC_API_KEY" in msg and "invalid x-api-key" in msg and "\n" not in msg


def test_claude_other_errors_give_status_and_message():
    err = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with pytest.raises(SparsetuneError, match="answered 529: Overloaded"):
        ClaudeProposer(MODEL, client=claude_client(Recorder(httpx2.Response(529, json=err)))).propose(context())

    def refuse(request):
        raise httpx2.ConnectError("connection refused", request=request)

    with pytest.raises(SparsetuneError, match="cannot reach the Anthropic API at http://mock"):
        ClaudeProposer(MODEL, client=claude_client(refuse)).propose(context())


def test_claude_overload_is_retried_by_the_sdk():
    err = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    rec = Recorder(httpx2.Response(529, json=err, headers={"retry-after-ms": "1"}),
                   httpx2.Response(200, json=claude_message({"source": "x", "rationale": "y"})))
    p = ClaudeProposer(MODEL, client=claude_client(rec, max_retries=2)).propose(context())
    assert p.source == "x" and len(rec.requests) == 2
    assert rec.requests[1].headers["x-stainless-retry-count"] == "1"


def test_claude_without_a_key_says_what_to_do(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(SparsetuneError) as e:
        ClaudeProposer(MODEL)
    msg = str(e.value)
    assert "ANTHROPIC_API_KEY" in msg and "--agent openai --agent-endpoint URL" in msg and "--agent evolve" in msg
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    built = ClaudeProposer(MODEL).client
    assert built.api_key == "sk-test" and built.max_retries == anthropic.DEFAULT_MAX_RETRIES > 0


# ---- cost -----------------------------------------------------------------------------------------


def test_cost_table_and_unknown_models():
    p_in, p_out = PRICES["claude-haiku-4-5"]
    assert cost_usd("claude-haiku-4-5", {"input_tokens": 10**6}) == pytest.approx(p_in)
    assert cost_usd("claude-haiku-4-5-20251001", {"output_tokens": 10**6}) == pytest.approx(p_out)  # a dated snapshot
    assert cost_usd("qwen3-8b", USAGE) == 0.0  # self-served: no API money
    # OpenAI-style usage maps into the same keys: cached prompt tokens are cache reads
    openai = {"prompt_tokens": 1000, "completion_tokens": 50, "prompt_tokens_details": {"cached_tokens": 600}}
    assert usage_dict(openai) == {"input_tokens": 400, "output_tokens": 50, "cache_creation_input_tokens": 0,
                                  "cache_read_input_tokens": 600}
    assert cost_usd("claude-haiku-4-5", openai) == pytest.approx((400 * p_in + 600 * 0.1 * p_in + 50 * p_out) / 1e6)


# ---- the prompt -----------------------------------------------------------------------------------


def test_static_prefix_is_the_language_the_ops_and_the_examples():
    text = static_prefix()
    for name in OPS:  # the op table comes from the op set itself
        assert f"`F.{name}(" in text, name
    assert "| `F.gemm(x, y)` |" in text and "2*S*m*n*k" in text and "| `F.transpose(x)` | Swap the two inner axes. | 0" in text
    for name in ("quest", "block_topk", "h2o"):
        assert flow_path(name).read_text().rstrip() in text
    assert "`ALLOWED_MODULES`: math, sparsetune.flow," in text  # the harness's own allow-list
    assert "`__import__`" in text and "RUNTIME_PARAMS" in text and "are read every step" in text
    assert static_prefix() is static_prefix()  # built once: the cached prefix never changes within a run


def test_round_message_shows_frontier_and_verdicts():
    text = round_message(context())
    assert text == round_message(context())
    assert "Goal: keep accuracy, read fewer bytes" in text
    assert '| cand_a | `{"budget_ratio": 0.0625}` | 0.981 | 2.346 | 0.125 |' in text
    assert "### 0000 `cand_a` (by claude): accepted" in text and "128 B per selection unit per KV head" in text
    assert "gate: relative accuracy 0.97 at its defaults (bar 0.5)" in text
    assert 'on the frontier: {"budget_ratio": 0.0625}: rel. acc. 0.981, speedup 2.346' in text
    assert "### 0001 `cand_b` (by claude): rejected at static" in text and "`import os` is not allowed" in text
    assert "x" * 600 not in text and "x" * 300 + "..." in text  # a long reason is cut
    assert "cand_a, cand_b, quest" in text and f"`{TOOL_NAME}`" in text
    many = context()
    many.candidates = [Candidate(f"{i:04d}", f"c{i}", "claude", "", stages=[Stage("static", False, "no", 0.0)])
                       for i in range(12)]
    shown = round_message(many)
    assert "(8 of 12, oldest first)" in shown and "`c3`" not in shown and "`c4`" in shown and "`c11`" in shown


# ---- OpenAI-compatible, through httpx2's mock transport -------------------------------------------

ENDPOINT = "http://localhost:30000/v1"


def completion(arguments, usage: dict | None = None, tool: bool = True) -> dict:
    message = {"role": "assistant", "content": None if tool else "I would use centroids."}
    if tool:
        message["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": TOOL_NAME, "arguments": arguments}}]
    return {"id": "c1", "object": "chat.completion", "model": "qwen3-8b",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool else "stop"}],
            "usage": usage or {"prompt_tokens": 5000, "completion_tokens": 300,
                               "prompt_tokens_details": {"cached_tokens": 4096}}}


def openai(rec: Recorder, model: str = "qwen3-8b", endpoint: str = ENDPOINT, **kw) -> OpenAIProposer:
    return OpenAIProposer(endpoint, model, client=httpx2.Client(transport=httpx2.MockTransport(rec)), **kw)


def test_openai_request_and_parsing(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    source = candidate_flow(name="cand_o")
    rec = Recorder(httpx2.Response(200, json=completion(json.dumps({"source": source, "rationale": "why"}))))
    ctx = context()
    p = openai(rec, endpoint=ENDPOINT + "/").propose(ctx)

    [req] = rec.requests
    assert req.method == "POST" and str(req.url) == ENDPOINT + "/chat/completions"
    assert "authorization" not in req.headers  # no key: a local server takes none
    body = rec.body()
    assert body["model"] == "qwen3-8b" and body["max_tokens"] > 0
    assert body["messages"] == [{"role": "system", "content": static_prefix()},
                                {"role": "user", "content": round_message(ctx)}]
    [tool] = body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == TOOL_NAME
    assert tool["function"]["parameters"] == TOOL_SCHEMA
    assert body["tool_choice"] == {"type": "function", "function": {"name": TOOL_NAME}}

    assert (p.source, p.rationale, p.proposer, p.parents) == (source, "why", "openai", [])
    assert p.usage == {"input_tokens": 5000 - 4096, "output_tokens": 300, "cache_creation_input_tokens": 0,
                       "cache_read_input_tokens": 4096}
    assert p.cost_usd == 0.0  # a self-served model
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert p.prompt_hash == hashlib.sha256(canonical.encode()).hexdigest()


def test_openai_key_and_priced_model(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-o")
    rec = Recorder(httpx2.Response(200, json=completion(json.dumps({"source": "x", "rationale": "y"}),
                                                        usage={"prompt_tokens": 100, "completion_tokens": 10})))
    p = openai(rec, model="claude-haiku-4-5").propose(context())
    assert rec.requests[0].headers["authorization"] == "Bearer sk-o"
    p_in, p_out = PRICES["claude-haiku-4-5"]
    assert p.cost_usd == pytest.approx((100 * p_in + 10 * p_out) / 1e6)


def test_openai_malformed_arguments_or_no_call_is_an_empty_source():
    p = openai(Recorder(httpx2.Response(200, json=completion('{"source": "class X(', )))).propose(context())
    assert p.source == "" and "not valid JSON" in p.rationale and p.usage["cache_read_input_tokens"] == 4096
    p = openai(Recorder(httpx2.Response(200, json=completion(None, tool=False)))).propose(context())
    assert p.source == "" and "without the propose_flow tool call" in p.rationale and "centroids" in p.rationale
    cut = completion('{"source": "class X(')
    cut["choices"][0]["finish_reason"] = "length"
    p = openai(Recorder(httpx2.Response(200, json=cut)), max_tokens=64).propose(context())
    assert p.source == "" and "cut at max_tokens=64" in p.rationale


def test_openai_http_errors_name_the_endpoint():
    with pytest.raises(SparsetuneError) as e:
        openai(Recorder(httpx2.Response(500, text="internal error"))).propose(context())
    assert f"{ENDPOINT}/chat/completions answered 500: internal error" in str(e.value)

    def refuse(request):
        raise httpx2.ConnectError("[Errno 111] Connection refused", request=request)

    with pytest.raises(SparsetuneError, match=f"cannot reach the agent endpoint {ENDPOINT}/chat/completions"):
        OpenAIProposer(ENDPOINT, "m", client=httpx2.Client(transport=httpx2.MockTransport(refuse))).propose(context())
    with pytest.raises(SparsetuneError, match="usually ending in /v1"):
        openai(Recorder(httpx2.Response(404, text="not found")), endpoint="http://localhost:30000").propose(context())


# ---- proposals through the harness ----------------------------------------------------------------

HARNESS_CASES = [  # (source, verdict, a phrase of the reason)
    (candidate_flow(name="h_good"), "accepted", None),
    (candidate_flow(name="h_syntax").replace("def index(self, q, fields):", "def index(self, q, fields)"),
     "rejected at static", "syntax error"),
    (candidate_flow(name="h_os", head=FLOW_HEAD + "import os\n"), "rejected at static", "`import os` is not allowed"),
    (candidate_flow("x = open('/etc/passwd')\n" + GOOD_INDEX, name="h_open"), "rejected at static",
     "`open` is not allowed"),
    (candidate_flow("m = __import__('os')\n" + GOOD_INDEX, name="h_import"), "rejected at static",
     "`__import__` is not allowed"),
    (candidate_flow(name="h_global", head=FLOW_HEAD + "from sparsetune.flow import check\n"), "rejected at static",
     "`from sparsetune.flow import check` is not allowed"),
    (candidate_flow('return F.topk(F.gemm(fields["centroid"], q))', name="h_shape"), "rejected at check",
     "F.topk needs a score of shape [S, 1, 1]"),
    (candidate_flow('return F.topk(F.fill(F.max(F.gemm(fields["centroid"], q), dim=2), 1.0))', name="h_constant"),
     "accepted", None),
    (candidate_flow('return F.topk(F.max(F.max(F.gemm(fields["keys"], q), dim=1), dim=2))',
                    cache='return {"keys": F.scale(k)}', name="h_keys"), "accepted", None),
]


def harness(tmp_path, p, number: int = 0) -> Candidate:
    """A proposal taken through the harness as the search's loop takes it."""
    cand = Candidate(f"{number:04d}", declared_name(p.source) or f"candidate_{number:04d}", p.proposer, p.source,
                     p.parents, p.rationale, p.prompt_hash, dict(p.usage or {}), p.cost_usd)
    return validate(cand, tmp_path / "candidates")


@pytest.mark.parametrize("source,verdict,needle", HARNESS_CASES, ids=[c[0].split('name = "')[1].split('"')[0]
                                                                    for c in HARNESS_CASES])
def test_claude_proposals_through_the_harness(tmp_path, source, verdict, needle):
    rec = Recorder(httpx2.Response(200, json=claude_message({"source": source, "rationale": "scripted"})))
    cand = harness(tmp_path, ClaudeProposer(MODEL, client=claude_client(rec)).propose(context()))
    assert cand.verdict == verdict, cand.reason
    if needle is not None:
        assert needle in cand.reason, cand.reason
    saved = json.loads((tmp_path / "candidates" / "0000" / "candidate.json").read_text())
    assert saved["proposer"] == "claude" and saved["usage"] == USAGE and saved["cost_usd"] > 0
    assert saved["prompt_hash"] and saved["verdict"] == verdict


def test_a_reply_without_the_tool_is_rejected_and_says_why(tmp_path):
    rec = Recorder(httpx2.Response(200, json=completion(None, tool=False)))
    cand = harness(tmp_path, openai(rec).propose(context()), number=7)
    assert cand.verdict == "rejected at static" and cand.source == ""  # nothing of it ran
    assert "no flow class" in cand.reason
    saved = json.loads((tmp_path / "candidates" / "0007" / "candidate.json").read_text())
    assert "without the propose_flow tool call" in saved["rationale"] and saved["reason"]
