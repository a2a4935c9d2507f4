"""Helpers shared by the tests (fixtures are in conftest.py): running the CLI, random paged decode
cases, HF references, tiny HF models on disk, and reuse prompts with their logits."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sparsetune.engine.attention import AttentionMetadata
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.sequence import SamplingParams
from sparsetune.flow.attention import FlowAttention
from sparsetune.reuse.parts import ReuseLayout, encode_parts, parse_parts

# ---- the command line ---------------------------------------------------------------------------

def sigint_default() -> None:
    """`preexec_fn` of a child a test interrupts with SIGINT: a shell that starts the suite in the
    background ignores SIGINT, and a CI runner may block it; children inherit both (the ignore and the
    signal mask survive exec), and Python then never raises KeyboardInterrupt. Undo both."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "sparsetune.cli.main", *args], capture_output=True, text=True, env=full_env, timeout=600
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), proc.stderr
    message = " ".join(lines[lines.index(next(x for x in lines if x.startswith("error:"))):])
    for n in needles:
        assert n in message, message


# ---- paged decode cases (flows and their kernels) ----------------------------------------------


HEAD_DIM, HKV, GROUP = 32, 2, 3


def paged_case(block_size: int, lens: list[int], seed: int = 0):
    """Random paged KV (shuffled blocks, garbage in unused table entries) and decode metadata."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in lens]
    kv = KVCache(1, sum(nblk) + 3, HKV, block_size, HEAD_DIM, torch.float64, "cpu")
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, dtype=torch.float64))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, dtype=torch.float64))
    perm = torch.randperm(kv.num_blocks, generator=g).tolist()
    width = max(nblk) + 2
    tables = []
    for n in nblk:
        row, perm = perm[:n], perm[n:]
        tables.append(row + [10**6] * (width - n))
    bt = torch.tensor(tables, dtype=torch.int32)
    meta = AttentionMetadata(False, torch.tensor([n - 1 for n in lens]), torch.zeros(len(lens), dtype=torch.long), bt,
                             torch.tensor(lens, dtype=torch.int32), lens, list(range(len(lens) + 1)), list(range(len(lens))))
    q = torch.randn(len(lens), HKV * GROUP, HEAD_DIM, generator=g, dtype=torch.float64)
    return kv, bt, meta, q


def prefill_cache(attn: FlowAttention, kv: KVCache, bt: torch.Tensor, lens: list[int]) -> None:
    """The cache stage over every full selection unit (a block, or a `select_block` unit inside one)."""
    units, u = attn.unit_table(bt), attn.flow.unit
    done = torch.cat([units[i, : n // u] for i, n in enumerate(lens)]).long()
    attn.run_cache(0, kv, done, done)


def selected_sets(attn, kv, bt, meta, q) -> list[list[set[int]]]:
    blocks, counts = attn.select(0, q, kv, meta)
    return [[set(blocks[b, h, : counts[b, h]].tolist()) for h in range(HKV)] for b in range(blocks.shape[0])]


def reference_selection(score: torch.Tensor, nblocks: int, budget_blocks: int, sink: int, local: int) -> set[int]:
    """The published rule's selection: forced sink/local blocks, then the top scores of the rest."""
    forced = set(range(min(sink, nblocks))) | set(range(max(0, nblocks - local), nblocks))
    k = min(nblocks, max(budget_blocks, sink + local))
    rest = [i for i in range(nblocks) if i not in forced]
    ranked = sorted(rest, key=lambda i: -score[i].item())
    return forced | set(ranked[: k - len(forced)])


def block_keys(kv, bt, b: int, h: int, nfull: int) -> torch.Tensor:
    return kv.k[0][bt[b, :nfull].long(), h]  # [nfull, bs, D]


# ---- HF transformers references -----------------------------------------------------------------


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, min_cos: float = 0.9999) -> None:
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert cos.min().item() >= min_cos, f"min per-position cosine {cos.min().item():.6f}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree == 1.0, f"argmax agrees at {agree:.3f} of positions"


def tiny_hf(kind: str, tmp_path, **extra):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    cfg_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[kind]
    cfg = cfg_cls(**common, **extra)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a dropped one shows up
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(tmp_path))
    return model


# ---- reuse prompts ------------------------------------------------------------------------------


DOC_A = "The secret code of the blue door is 4417. The red door has no code at all. " * 3


DOC_B = "Paris is the capital of France. The Seine flows through it from east to west. " * 3


def reuse_parts(first_plain: bool = True):
    seg = lambda t: {"text": t, "reuse": True, "namespace": "kb"}  # noqa: E731
    body = [seg(DOC_A), "\n\n", seg(DOC_B), "\n\nQuestion: what is the secret code of the blue door? Answer:"]
    return (["Read the documents below.\n\n"] if first_plain else []) + body


def reuse_logits(llm, flow: str, parts, params: dict[str, str] | None = None, warm: bool = True):
    """Last-token logits of a reuse prefill run by the scheduler (after a cache-building pass when
    `warm`), its stats, its layout and its layer-0 keys."""
    layout = encode_parts(llm.tokenizer, parse_parts(parts), chat=False)
    llm.use_reuse(flow, params)
    try:
        if warm:  # the two-stage protocol: the first request stores the segments
            llm.generate([parts], SamplingParams(max_tokens=1), chat=False)
        seq, stats = llm.add_reuse_request(layout, SamplingParams(max_tokens=2, ignore_eos=True, keep_logits=True))
        try:
            while not seq.logits:
                llm.engine.step()
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=llm.engine.kv.k.device)
            layer0_k = llm.engine.kv.gather(0, table, layout.num_tokens)[0].clone()
        finally:
            llm.engine.abort(seq)
            while llm.engine.scheduler.has_work():
                llm.engine.step()
    finally:
        llm.use_reuse(None)
    return seq.logits[0], stats, layout, layer0_k


def plain_logits(llm, layout: ReuseLayout) -> torch.Tensor:
    return llm.engine.prompt_logits(layout.token_ids)[-1]


class SyntheticEvaluator:
    """A search evaluator without an engine (a `tuning.protocols.TrialEvaluator`), for the study
    loop's own tests: speed is the real cost model (modeled); accuracy a fixed function of the params
    (small blocks and larger budgets keep more), reported in two chunks so the cascade can stop a
    trial after the first. `fail`: params
    for which a trial raises (a crash); `sleep`: seconds per trial; `calls`: every point evaluated."""

    def __init__(self, cfg, fail=None, sleep: float = 0.0) -> None:
        self.cfg, self.fail, self.sleep, self.calls = cfg, fail, sleep, []

    @staticmethod
    def relative(params: dict) -> float:
        import math

        bs = int(params.get("block_size", 16))
        ratio = float(params.get("budget_ratio", 0.125))
        return round(max(0.0, min(1.02, 1.05 - 0.12 * math.log2(bs) * (0.125 / ratio) ** 0.5 + 0.01 * int(params.get("local_blocks", 2)))), 4)

    def speed_after_accuracy(self) -> bool:
        return False

    def speedup(self, flow, params, accuracy=None):
        from sparsetune.models.resolve import model_config
        from sparsetune.perf.cost import byte_floor_speedup
        from sparsetune.loader import build_flow

        mcfg = model_config(self.cfg.model, False)[1]
        return round(byte_floor_speedup(mcfg, build_flow(flow, params), self.cfg.batch, self.cfg.context, 2), 4), {"kind": "modeled"}

    def accuracy(self, flow, params, *, samples, seed, out, on_chunk=None):
        import time as _time

        from sparsetune.tuning.protocols import Hopeless
        from sparsetune.tuning.trial import Accuracy

        self.calls.append((flow, dict(params), samples, seed))
        if self.fail is not None and self.fail(params):
            raise RuntimeError("CUDA out of memory (synthetic)")
        _time.sleep(self.sleep)
        rel = self.relative(params) - (0.01 if seed != self.cfg.seed else 0.0)  # fresh prompts: a little lower
        n = 8 * samples
        make = lambda k, done: Accuracy(rel, 0.5 * rel, 0.5, k, {"top1": 0.9}, str(out), done)  # noqa: E731
        if on_chunk is not None:
            try:
                on_chunk({"relative_accuracy": rel, "samples_done": n // 2})
            except Hopeless:
                return make(n // 2, False)
        return make(n, True)


# ---- candidate flow files (the agent's harness and loop) -------------------------------------------

FLOW_HEAD = "from sparsetune.flow import DecodeFlow\nfrom sparsetune.flow import ops as F\n"
GOOD_INDEX = 'return F.topk(F.max(F.gemm(fields["centroid"], q), dim=2))'


def candidate_flow(index: str = GOOD_INDEX, cache: str = 'return {"centroid": F.mean(k, dim=1)}',
                   head: str = FLOW_HEAD, name: str = "cand") -> str:
    """A flow file as an agent would write it: `cache` and `index` stage bodies (index may be
    several lines), under `head` (the imports)."""
    import textwrap

    return head + textwrap.dedent(f"""

        class Cand(DecodeFlow):
            name = "{name}"

            def cache(self, k, v):
                {cache}

            def index(self, q, fields):
        """) + textwrap.indent(textwrap.dedent(index).strip(), " " * 8) + "\n"


# ---- the Anthropic SDK through its own transport hook (no network) ----------------------------------

CLAUDE_MODEL = "claude-sonnet-4-6"
CLAUDE_USAGE = {"input_tokens": 1234, "output_tokens": 567, "cache_creation_input_tokens": 4000,
                "cache_read_input_tokens": 8000}


def claude_client(handler, max_retries: int = 0):
    """An `anthropic.Anthropic` whose requests go to `handler(httpx2.Request) -> httpx2.Response`."""
    import anthropic
    import httpx2

    return anthropic.Anthropic(api_key="test", base_url="http://mock", max_retries=max_retries,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def claude_message(tool_input: dict | None, usage: dict = CLAUDE_USAGE, text: str = "") -> dict:
    """A Messages API reply: the `propose_flow` tool call with `tool_input` (None: text only)."""
    from sparsetune.agents.llm import TOOL_NAME

    content = [{"type": "text", "text": text}] if text else []
    if tool_input is not None:
        content.append({"type": "tool_use", "id": "toolu_1", "name": TOOL_NAME, "input": tool_input})
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": CLAUDE_MODEL, "content": content,
            "stop_reason": "tool_use" if tool_input is not None else "end_turn", "stop_sequence": None, "usage": usage}

