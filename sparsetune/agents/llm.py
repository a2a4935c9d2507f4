"""`claude` and `openai`: the LLM proposers of `sparsetune search --agent claude|openai`.

Each round one request: a static prefix (`static_prefix`: the flow language, the op table with
each op's cost, the harness's rules, example flows), cached by the provider between rounds, and a
round message (`round_message`: the goal, the frontier, the recent candidates and their verdicts).
The model must answer with one call of the tool `propose_flow` (`TOOL_NAME`, `TOOL_SCHEMA`): the
whole flow file and a rationale. A reply without the call, or with unreadable arguments, becomes a
`Proposal` with an empty source whose rationale says so: the harness rejects it (an empty file
defines no flow) and the search records it, like any other rejection.

- `ClaudeProposer`: the Anthropic SDK (2.x; `messages.create` with the prefix as a system block
  marked `cache_control: ephemeral`, the tool forced by `tool_choice`; no sampling parameters, which
  SDK 2.x no longer takes). Its retries (429, 529 overloaded, 5xx, connection errors) are the SDK's
  own `max_retries` (SDK default on a client built here).
- `OpenAIProposer`: an OpenAI-compatible `/chat/completions` endpoint (SGLang, vLLM, a hosted API)
  through `httpx2`, the tool forced as a named function.

Every proposal carries `prompt_hash` (sha256 of the request body as canonical JSON), the token
usage in one set of keys (`USAGE_KEYS`) and its cost (`cost_usd`, from `PRICES`). What the round
message shows of earlier candidates (their reasons quote sandboxed children's output) is scrubbed
of credentials (`sparsetune.sandbox.scrub`) before it is sent.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
from typing import Any

from sparsetune.agents.proposer import Context, Proposal
from sparsetune.errors import SparsetuneError
from sparsetune.sandbox import scrub

# ---- prices ---------------------------------------------------------------------------------------

# USD per million tokens (input, output), list prices as of 2026-11, from Anthropic's pricing page
# (platform.claude.com/docs/en/about-claude/pricing, "Model pricing"), read from a stored copy, not
# checked live: check them there before relying on a budget. Prompt caching (5-minute writes, the
# only TTL this module asks for) is billed at CACHE_WRITE x input, cache reads at CACHE_READ x input;
# those are the ratios of these three models. Some newer models read the cache at other ratios, so
# add a model here only together with its own ratios.
PRICES: dict[str, tuple[float, float]] = {
    "claude-opus-4-7": (5.00, 25.00),
    "claude-sonnet-4-6": (3.00, 15.00),
    "claude-haiku-4-5": (1.00, 5.00),
}
CACHE_WRITE = 1.25  # x input price, 5-minute cache write
CACHE_READ = 0.10  # x input price, cache hit
USAGE_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
_DATED = re.compile(r"-\d{8}$")  # a snapshot id, "claude-haiku-4-5-20251001": priced as its alias


def usage_dict(usage: dict[str, Any] | None) -> dict[str, int]:
    """A call's token usage in `USAGE_KEYS` (missing counts are 0). OpenAI-style usage
    (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`) is mapped into
    them: the prompt tokens read from the provider's cache are `cache_read_input_tokens`, the
    rest `input_tokens` (OpenAI counts cached tokens inside `prompt_tokens`)."""
    u = dict(usage or {})
    if "prompt_tokens" in u or "completion_tokens" in u:
        cached = int(((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        prompt = int(u.get("prompt_tokens") or 0)
        return {"input_tokens": max(0, prompt - cached), "output_tokens": int(u.get("completion_tokens") or 0),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": min(cached, prompt)}
    return {k: int(u.get(k) or 0) for k in USAGE_KEYS}


def cost_usd(model: str, usage: dict[str, Any] | None) -> float:
    """What a call cost in USD at `PRICES`: uncached input, 5-minute cache writes, cache reads
    and output. A model not in the table (a self-served one, behind `--agent openai`) costs 0.0:
    it spends no API money; its usage is still recorded with the candidate."""
    price = PRICES.get(model) or PRICES.get(_DATED.sub("", model))
    if price is None:
        return 0.0
    p_in, p_out = price
    u = usage_dict(usage)
    dollars = (u["input_tokens"] * p_in + u["cache_creation_input_tokens"] * CACHE_WRITE * p_in
               + u["cache_read_input_tokens"] * CACHE_READ * p_in + u["output_tokens"] * p_out)
    return dollars / 1e6


# ---- the tool ---------------------------------------------------------------------------------------

TOOL_NAME = "propose_flow"
TOOL_DESCRIPTION = ("Propose one new decode flow: the whole flow file (a Python module with one DecodeFlow "
                    "subclass, as in the examples) and why it should do better than the frontier.")
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "source": {"type": "string", "description": "the whole flow file, ready to save as <name>.py"},
        "rationale": {"type": "string", "description": "one or two sentences: the idea, and why it should "
                                                       "read fewer bytes or keep more accuracy than the frontier"},
    },
    "required": ["source", "rationale"],
}
EXAMPLE_FLOWS = ("block_topk", "quest", "h2o", "quest_2l")
DEFAULT_CLAUDE_MODEL = "claude-sonnet-4-6"
MAX_TOKENS = 8192  # a flow file and a rationale; well under the SDK's non-streaming limit (~21k)


def _require(module: str) -> Any:
    """Import an optional dependency of the LLM proposers, or say how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SparsetuneError(f"the LLM proposers need the package {module!r}: pip install 'sparsetune[agents]' "
                              "(anthropic>=2,<3 and httpx2); or use --agent evolve (no LLM)") from None


def canonical_hash(body: dict[str, Any]) -> str:
    """sha256 (hex) of a request body as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the prompt: the static prefix ----------------------------------------------------------------


def _doc_paragraphs(doc: str | None, first: int | None = None) -> str:
    """A docstring's paragraphs (the first `first` of them), dedented."""
    paras = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(paras[:first] if first else paras)


def _signature(name: str, fn: Any) -> str:
    """`F.name(x, dim, scale=1.0)`: the op's parameters as a flow calls them (no annotations)."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        parts.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return f"F.{name}({', '.join(parts)})"


def _first_clause(text: str) -> str:
    """`text` up to its first semicolon outside parentheses."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            return text[:i]
    return text


def _op_what(name: str, fn: Any) -> str:
    """The first line of the op's docstring; for an op made by a factory of `flow.ops` (the
    elementwise ops, the reductions), the factory's first clause; else "as torch.<name>"."""
    from sparsetune.flow import ops

    doc = inspect.getdoc(fn)
    if doc:
        return doc.splitlines()[0]
    factory = getattr(ops, fn.__qualname__.split(".<locals>")[0], None) if "<locals>" in fn.__qualname__ else None
    if factory is not None and factory.__doc__:
        head = _first_clause(inspect.getdoc(factory)).rstrip(".")
        return f"{name}: {head[0].lower()}{head[1:]}"
    import torch

    return f"as torch.{name}" if hasattr(torch, name) else ""


def _op_cost(name: str, op: Any) -> str:
    """The op's cost as the tracer counts it (`flows check`: indexer FLOPs per KV head), read from
    the op's own cost function on probe shapes."""
    from sparsetune.flow.ops import Op

    if name == "topk":
        return "S (one per block)"
    if not isinstance(op, Op):
        return "none"
    if op.flops is None:
        return "1 per output element"
    import torch

    from sparsetune.flow.values import FT

    s, m, n, k = 3, 2, 5, 7
    x, y = FT(torch.zeros(1, s, m, k)), FT(torch.zeros(1, 1, n, k))
    params = list(inspect.signature(op.fn).parameters)
    try:
        got = op.flops(x, y) if params == ["x", "y"] else op.flops(x, *([1] * (len(params) - 1)))
    except Exception:  # noqa: BLE001 - a cost function this probe does not fit: say where to look
        return "see sparsetune/flow/ops.py"
    if got == 0:
        return "0 (layout only)"
    if params == ["x", "y"] and got == 2 * s * m * n * k:
        return "2*S*m*n*k for [S, m, k] x [S, n, k]"
    return "see sparsetune/flow/ops.py"


def op_table() -> str:
    """Every op a flow may call (`flow.ops.OPS`), one markdown row each: the call, what it does,
    its cost and how a GPU runs it (a generated Triton kernel, or why not)."""
    from sparsetune.flow.ops import OPS, Op

    rows = ["| call | what it does | cost (FLOPs per KV head) | on GPU |", "|---|---|---|---|"]
    for name in sorted(OPS):
        fn = OPS[name]
        if isinstance(fn, Op):
            gpu = "generated Triton kernel" if fn.emit is not None else f"torch.compile ({fn.not_local})"
            target = fn.fn
        else:
            gpu, target = "runtime", fn
        what = _op_what(name, target).replace("|", "\\|")
        rows.append(f"| `{_signature(name, target)}` | {what} | {_op_cost(name, fn)} | {gpu} |")
    return "\n".join(rows)


def _inherited_params() -> str:
    from sparsetune.flow.base import RUNTIME_PARAMS, DecodeFlow

    lines = []
    for name, spec in DecodeFlow.param_specs().items():
        runtime = " (the runtime applies it: a stage may not read it)" if name in RUNTIME_PARAMS else ""
        lines.append(f"- `{name}`: {spec.describe()}: {spec.doc}{runtime}")
    return "\n".join(lines)


def _static_rules() -> str:
    """The source-check rules as `flow.source_check` states them (its docstring's numbered rules)."""
    from sparsetune.flow import source_check

    doc = inspect.cleandoc(source_check.__doc__ or "")
    m = re.search(r"(1\. Top level.*?)\n\nThis is a pre-check", doc, re.S)
    return m.group(1) if m else doc


def _indent(text: str) -> str:
    return "\n".join("   " + line if line else line for line in text.splitlines())


@functools.lru_cache(maxsize=1)
def static_prefix() -> str:
    """The part of every request that does not change between rounds (the provider caches it):
    the flow language, the op table, the harness's rules and example flow files. Built from the
    code (docstrings, `flow.ops.OPS`, `DecodeFlow`'s params, the built-in flow files)."""
    from sparsetune.flow import base, check, ops
    from sparsetune.flow.source_check import ALLOWED_MODULES, IMPORT_TIME_CALLS, VALUE_BUILTINS
    from sparsetune.loader import builtin_flows, flow_path

    examples = "\n\n".join(f"### flows/{name}.py\n\n```python\n{flow_path(name).read_text().rstrip()}\n```"
                           for name in EXAMPLE_FLOWS)
    imports = ", ".join(sorted(m for m in ALLOWED_MODULES if m != "__future__"))
    return f"""You write sparse-attention decode flows for sparsetune, a toolkit that searches sparse-attention \
methods for LLM decoding. A search tunes flows' parameters and keeps a frontier of relative accuracy (to \
dense attention) against decode speed. Each round you are shown the goal, the frontier so far and the \
latest candidates with their verdicts, and you propose ONE new flow by calling the tool `{TOOL_NAME}` with \
the whole flow file and a one- or two-sentence rationale. Propose something new each round: learn from \
the verdicts, do not resubmit a rejected idea unchanged.

# The flow language

{_doc_paragraphs(base.__doc__)}

{_doc_paragraphs(ops.__doc__, 2)}

A flow file imports `DecodeFlow` (or `TwoLevelFlow`) and `Param` from `sparsetune.flow` and `ops as F` from \
`sparsetune.flow`, and defines one class that subclasses `DecodeFlow` (or `TwoLevelFlow`) with:
- `name = "..."`: a new lowercase identifier ([a-z][a-z0-9_]*, at most 64 characters), unused in the search;
- `source = "..."`: one line on the idea (and its paper, if it has one);
- optional hyperparameters `Param(default, low=..., high=..., log=..., choices=..., doc="...")`: the search \
tunes each one in its range (read them as `self.<name>` in the stages);
- `cache(self, k, v)` returning a dict of fields, and `index(self, q, fields)` ending in \
`return F.topk(score)` with `score` of shape [S, 1, 1]; helper methods called through `self` are allowed;
- for two levels, subclass `TwoLevelFlow` (16-token pages, 2-token units, the best `coarse` = 2 x the budget \
pages kept; the search tunes the unit and `coarse`) and optionally define `cache_page(self, k, v)` and \
`index_page(self, q, fields)`, the same stages over whole pages (without them the unit stages score pages \
too). Its `index` must be block-local (no `dim=0` reduction, no `F.save`): the second level scores only the \
kept pages' units.

Every flow inherits these params:
{_inherited_params()}

# The ops (`F.*`)

Shapes: `[S, a, b]`, S the block axis; `dim=0` reduces over blocks, `dim=1`/`dim=2` over the inner axes \
(all reductions keep the dimension). The cost column is what `flows check` counts as indexer work per KV \
head and step (S blocks). On a GPU, a stage whose calls all have a generated kernel runs as one Triton \
kernel; an op without one, or a call that is not block-local (a reduction over blocks, `dim=0`), makes the \
stage run under torch.compile (slower).

{op_table()}

# The harness every candidate goes through

1. **static**: the file is read as a syntax tree (nothing of it runs) and must keep to these rules:

{_indent(_static_rules())}

   `ALLOWED_MODULES`: {imports}. `IMPORT_TIME_CALLS`: {", ".join(sorted(IMPORT_TIME_CALLS))}. Value \
builtins a stage may call: {", ".join(sorted(VALUE_BUILTINS))}. A refusal names the line and the rule.
2. **check** (`flows check`, in a sandboxed subprocess with wall-clock, memory and CPU limits; a hang or \
an unbounded allocation is killed):

{_indent(_doc_paragraphs(check.__doc__))}

3. **gate**: the flow at its defaults on prompts drawn for it alone; its accuracy relative to dense must \
reach a share of the weakest built-in flow's.
4. **study**: its params join the search like any flow's; the trials measure relative accuracy and speed.

What the runtime does, not the flow: it picks the blocks. Every sequence keeps its first `sink_blocks` and \
last `local_blocks` blocks, and the budget (`budget` tokens or `budget_ratio` of the context) is filled \
with the top-scoring other blocks; the search tunes the budget. A flow only scores blocks; it must not read \
the budget, sink, local or layer params.

What counts in speed: a decode step reads the weights, the K/V of the blocks attended, and on every \
selecting layer the cached fields of EVERY block of the context. A field's bytes (2 bytes per element, per \
block and KV head) are read every step, so fields must be much smaller than the block's keys \
(block_size x head_dim): caching the keys themselves (or anything as large) reads as many bytes as dense \
attention and gains nothing. A two-level flow reads every page's page fields, then the unit fields of the \
kept pages only (`coarse` x the budget), so its unit fields may be richer; on an H200 at 16 x 32K its \
two top-k passes and the second scoring cost about 2.5 ms a step more than one level over 16-token pages \
(1.98x over dense against 2.56x), and a page score that misses a page's best unit costs accuracy. The \
indexer's arithmetic also costs time on a GPU. A flow that scores every \
block the same (a constant score) passes the checks but selects nothing useful; the search scores it, \
it is not refused.

Built-in flow names (taken): {", ".join(sorted(builtin_flows()))}.

# Example flows

{examples}
"""


# ---- the prompt: the round message ----------------------------------------------------------------

RECENT = 8  # candidates shown each round
REASON_CHARS = 400
SOURCE_CHARS = 1500
FRONTIER_ROWS = 16


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else "-" if x is None else str(x)


def _cut(text: str, n: int) -> str:
    text = text.strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def _params(params: Any) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def _candidate_lines(c: Any, frontier: list[dict[str, Any]]) -> list[str]:
    """A candidate as the round message shows it; every line scrubbed of credentials (`sandbox.scrub`:
    a reason quotes what a sandboxed child printed), the long ones before they are cut."""
    lines = [f"### {c.id} `{c.name}` (by {c.proposer}): {c.verdict}"]
    if c.rationale:
        lines.append(f"rationale: {_cut(scrub(c.rationale), REASON_CHARS)}")
    if c.reason:
        lines.append(f"reason: {_cut(scrub(c.reason), REASON_CHARS)}")
    for s in c.stages:
        if s.name == "check" and s.ok:
            r = s.detail.get("report") or {}
            lines.append(f"check: fields {json.dumps(r.get('fields'), sort_keys=True)}, "
                         f"{r.get('field_bytes_per_block')} B per selection unit per KV head, "
                         f"{r.get('indexer_flops_per_block')} indexer FLOPs per block"
                         + "".join(f"; {k} on GPU: {v}" for k, v in sorted((r.get("compiled") or {}).items())))
        elif s.name == "gate" and "relative_accuracy" in s.detail:
            lines.append(f"gate: relative accuracy {_num(s.detail.get('relative_accuracy'))} at its defaults "
                         f"(bar {_num(s.detail.get('bar'))})")
    landed = getattr(c, "landed", None)
    if landed:
        lines.append(f"landed: {json.dumps(landed, sort_keys=True, default=str)}")
    elif c.verdict == "accepted":
        mine = [r for r in frontier if r.get("flow") == c.name]
        lines.append("on the frontier: " + "; ".join(
            f"{_params(r.get('params'))}: rel. acc. {_num(r.get('relative_accuracy'))}, speedup "
            f"{_num(r.get('speedup'))}" for r in mine) if mine else "not on the frontier (yet)")
    if c.source:
        lines += ["```python", _cut(scrub(c.source), SOURCE_CHARS), "```"]
    return [scrub(line) for line in lines]


def round_message(ctx: Context) -> str:
    """This round's user message: the goal, the frontier (params and measured figures), the last
    `RECENT` candidates (verdict, reason, cost, where they landed, source) and the instruction to
    answer with the tool. Deterministic: the same context gives the same text."""
    out = [f"Round {ctx.round}.", "", f"Goal: {ctx.goal}", "", "## The frontier (fastest first)", ""]
    if ctx.frontier:
        out += ["| flow | params | relative accuracy | speedup | K/V share |", "|---|---|---|---|---|"]
        for r in ctx.frontier[:FRONTIER_ROWS]:
            out.append(f"| {r.get('flow')} | `{_params(r.get('params'))}` | {_num(r.get('relative_accuracy'))} | "
                       f"{_num(r.get('speedup'))} | {_num(r.get('kv_share'))} |")
        if len(ctx.frontier) > FRONTIER_ROWS:
            out.append(f"(and {len(ctx.frontier) - FRONTIER_ROWS} more points)")
    else:
        out.append("No point measured yet.")
    recent = ctx.candidates[-RECENT:]
    out += ["", f"## Recent candidates ({len(recent)} of {len(ctx.candidates)}, oldest first)", ""]
    if not recent:
        out.append("None yet.")
    for c in recent:
        out += _candidate_lines(c, ctx.frontier) + [""]
    taken = sorted({str(r.get("flow")) for r in ctx.frontier} | {c.name for c in ctx.candidates})
    if taken:
        out += ["", f"Names taken in this search (besides the built-in flows): {', '.join(taken)}."]
    out += ["", f"Answer by calling `{TOOL_NAME}` once, with the whole new flow file as `source` and one or two "
                "sentences as `rationale`."]
    return "\n".join(out)


def _no_tool(proposer: str, why: str, usage: dict[str, int], cost: float, prompt_hash: str) -> Proposal:
    """A reply the harness cannot use: an empty source (the harness rejects it) that says why."""
    return Proposal("", proposer, [], rationale=why, prompt_hash=prompt_hash, usage=usage, cost_usd=cost)


def _tool_proposal(proposer: str, args: Any, usage: dict[str, int], cost: float, prompt_hash: str) -> Proposal:
    if not isinstance(args, dict) or not isinstance(args.get("source"), str):
        return _no_tool(proposer, f"the model called {TOOL_NAME} without a string `source` "
                        f"(got {_cut(json.dumps(args, default=str), 200)})", usage, cost, prompt_hash)
    rationale = args.get("rationale")
    return Proposal(args["source"], proposer, [], rationale=rationale if isinstance(rationale, str) else "",
                    prompt_hash=prompt_hash, usage=usage, cost_usd=cost)


# ---- Claude ---------------------------------------------------------------------------------------


class ClaudeProposer:
    """`--agent claude`: one Anthropic Messages call per round (module docstring). `client`: an
    `anthropic.Anthropic` (tests pass one with a mock transport); without it one is built from
    `ANTHROPIC_API_KEY` (honouring `ANTHROPIC_BASE_URL`), with the SDK's default retries."""

    name = "claude"

    def __init__(self, model: str = DEFAULT_CLAUDE_MODEL, client: Any = None, max_tokens: int = MAX_TOKENS) -> None:
        self.model, self.max_tokens = model, max_tokens
        if client is None:
            key = os.environ.get("ANTHROPIC_API_KEY")
            if not key:
                raise SparsetuneError("--agent claude needs ANTHROPIC_API_KEY set to an Anthropic API key; or use "
                                      "--agent openai --agent-endpoint URL (an OpenAI-compatible server) or "
                                      "--agent evolve (no LLM)")
            client = _require("anthropic").Anthropic(api_key=key)
        self.client = client

    def request(self, ctx: Context) -> dict[str, Any]:
        """The `messages.create` arguments for this round (what `prompt_hash` hashes)."""
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": [{"type": "text", "text": static_prefix(), "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}],
            "tool_choice": {"type": "tool", "name": TOOL_NAME},
            "messages": [{"role": "user", "content": round_message(ctx)}],
        }

    def propose(self, ctx: Context) -> Proposal:
        anthropic = _require("anthropic")
        body = self.request(ctx)
        prompt_hash = canonical_hash(body)
        try:
            msg = self.client.messages.create(**body)
        except anthropic.AuthenticationError as e:
            raise SparsetuneError(f"the Anthropic API refused the key ({e.status_code}: {_api_message(e)}); check "
                                  "ANTHROPIC_API_KEY") from None
        except anthropic.APIStatusError as e:
            raise SparsetuneError(f"the Anthropic API answered {e.status_code}: {_api_message(e)}") from None
        except anthropic.APIConnectionError as e:
            raise SparsetuneError(f"cannot reach the Anthropic API at {self.client.base_url}: {e.message} "
                                  f"({type(e.__cause__ or e).__name__})") from None
        except anthropic.APIError as e:
            raise SparsetuneError(f"the Anthropic API call failed: {e.message}") from None
        raw = msg.usage.model_dump() if msg.usage is not None else {}
        usage = usage_dict(raw)
        cost = cost_usd(self.model, usage)
        block = next((b for b in msg.content if b.type == "tool_use" and b.name == TOOL_NAME), None)
        if msg.stop_reason == "max_tokens":
            return _no_tool(self.name, f"the reply was cut at max_tokens={self.max_tokens} before the "
                            f"{TOOL_NAME} call was complete", usage, cost, prompt_hash)
        if block is None:
            text = " ".join(b.text for b in msg.content if b.type == "text")
            return _no_tool(self.name, f"the model answered without the {TOOL_NAME} tool call (stop reason "
                            f"{msg.stop_reason}): {_cut(text, 300)}", usage, cost, prompt_hash)
        return _tool_proposal(self.name, block.input, usage, cost, prompt_hash)


def _api_message(e: Any) -> str:
    """The error message of an Anthropic error body ({"error": {"message": ...}}), else the SDK's."""
    body = getattr(e, "body", None)
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return _cut(str(msg or e.message), 300)


# ---- OpenAI-compatible ----------------------------------------------------------------------------


class OpenAIProposer:
    """`--agent openai`: one chat-completions call per round to an OpenAI-compatible server.

    `endpoint` is the API's base URL including its version path, as OpenAI clients take it (e.g.
    `http://localhost:30000/v1` for SGLang, `https://api.openai.com/v1`): the request goes to
    `{endpoint}/chat/completions`. `api_key` (default `OPENAI_API_KEY`, optional: local servers
    take none) is sent as a Bearer token. `client`: an `httpx2.Client` (tests pass one with a mock
    transport). A model not in `PRICES` costs 0.0 (a self-served model spends no API money)."""

    name = "openai"

    def __init__(self, endpoint: str, model: str, api_key: str | None = None, client: Any = None,
                 max_tokens: int = MAX_TOKENS, timeout_s: float = 600.0) -> None:
        httpx2 = _require("httpx2")
        self.endpoint, self.model, self.max_tokens = endpoint.rstrip("/"), model, max_tokens
        self.url = f"{self.endpoint}/chat/completions"
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY") or None
        self.client = client if client is not None else httpx2.Client(timeout=httpx2.Timeout(timeout_s, connect=10.0))

    def request(self, ctx: Context) -> dict[str, Any]:
        """The JSON body for this round (what `prompt_hash` hashes)."""
        return {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": [{"role": "system", "content": static_prefix()},
                         {"role": "user", "content": round_message(ctx)}],
            "tools": [{"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                                        "parameters": TOOL_SCHEMA}}],
            "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}},
        }

    def propose(self, ctx: Context) -> Proposal:
        httpx2 = _require("httpx2")
        body = self.request(ctx)
        prompt_hash = canonical_hash(body)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            resp = self.client.post(self.url, json=body, headers=headers)
        except httpx2.HTTPError as e:
            raise SparsetuneError(f"cannot reach the agent endpoint {self.url}: {e or type(e).__name__}; is the "
                                  "server running at --agent-endpoint?") from None
        if resp.status_code >= 400:
            hint = {401: "; check OPENAI_API_KEY", 403: "; check OPENAI_API_KEY",
                    404: "; --agent-endpoint is the API's base URL, usually ending in /v1"}.get(resp.status_code, "")
            raise SparsetuneError(f"the agent endpoint {self.url} answered {resp.status_code}: "
                                  f"{_cut(' '.join(resp.text.split()), 300)}{hint}")
        try:
            data = resp.json()
            message = data["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError):
            raise SparsetuneError(f"the agent endpoint {self.url} answered something other than a chat "
                                  f"completion: {_cut(' '.join(resp.text.split()), 300)}") from None
        usage = usage_dict(data.get("usage") if isinstance(data.get("usage"), dict) else {})
        cost = cost_usd(self.model, usage)
        calls = [c for c in (message.get("tool_calls") or []) if (c.get("function") or {}).get("name") == TOOL_NAME]
        if data["choices"][0].get("finish_reason") == "length":
            return _no_tool(self.name, f"the reply was cut at max_tokens={self.max_tokens} before the "
                            f"{TOOL_NAME} call was complete", usage, cost, prompt_hash)
        if not calls:
            text = message.get("content") if isinstance(message.get("content"), str) else ""
            return _no_tool(self.name, f"the model answered without the {TOOL_NAME} tool call (finish reason "
                            f"{data['choices'][0].get('finish_reason')}): {_cut(text, 300)}", usage, cost, prompt_hash)
        args = calls[0]["function"].get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                return _no_tool(self.name, f"the model's {TOOL_NAME} arguments are not valid JSON ({e}): "
                                f"{_cut(args, 200)}", usage, cost, prompt_hash)
        return _tool_proposal(self.name, args, usage, cost, prompt_hash)
