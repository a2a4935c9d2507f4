"""Where a batched reuse prefill step's time goes (issue #42, item 5): B reuse requests of a RAG
workload prefilled together in one scheduler step, against the same requests one to a step.

    python benchmarks/bench_reuse_step.py --model qwen3-8b --flows cacheblend,sparsex,a3 --batches 1,2,4

Prompts are `bench serve --reuse --workload rag`'s (`perf/workloads.draw`: `--per-prompt` documents
of `--doc-len` tokens from a corpus of `--docs`, Zipf popularity, then `--question-len` fresh
tokens), the corpus stored first (every segment a hit). For each flow and batch size B the step
budget (`max_num_batched_tokens`) is B prompts' rows, so the B requests share one step; every
request asks for one output token, so a step is exactly one batched reuse prefill. Per (flow, B):

- the step's wall time (median of `--repeats`, synchronized) and per request;
- its profile (`perf.step_profile.profile_call`, GPU kernel time): realign (segments copied in,
  keys rotated), selection (the flow's `select` at its selection layer: the `indexer` stage),
  attention (the rows over the whole prompt's keys), KV stores, and the recompute's GEMMs, norms,
  RoPE and activation;
- the floor: the plan's matmul FLOPs (`perf.cost.prefill_flops` of what the executor counted, summed
  over the B requests) at the bf16 GEMM rate, plus the realign's bytes (every reused token's K and V
  in every layer, read and written) at the copy bandwidth, both measured in the same run.

`plain` is a full prefill of the same prompts (no reuse flow), B of them to a step, for reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_copy_bandwidth, measure_matmul_flops  # noqa: E402

from sparsetune.cli.output import parse_size  # noqa: E402
from sparsetune.engine.sequence import SamplingParams  # noqa: E402
from sparsetune.llm import LLM  # noqa: E402
from sparsetune.perf.cost import prefill_flops  # noqa: E402
from sparsetune.perf.step_profile import profile_call  # noqa: E402
from sparsetune.perf.timing import sync  # noqa: E402
from sparsetune.perf.workloads import ReuseWorkload, draw  # noqa: E402

ONCE = SamplingParams(max_tokens=1, ignore_eos=True)


def _queue(llm: LLM, layouts) -> list:
    if llm.reuse_flow is None:
        return [(llm.engine.add_request(x.token_ids, ONCE), None) for x in layouts]
    return [llm.add_reuse_request(x, ONCE) for x in layouts]


def _step(llm: LLM, layouts) -> list:
    """Queue the prompts and run the one step that prefills them all; returns (seq, stats) pairs."""
    got = _queue(llm, layouts)
    llm.engine.step()
    if any(s.num_completion_tokens != 1 for s, _ in got):
        raise SystemExit("the requests did not share one step: raise the step budget")
    while llm.engine.scheduler.has_work():
        llm.engine.step()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--flows", default="cacheblend,sparsex,a3")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=4096)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-memory", default="80GiB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--no-plain", action="store_true", help="skip the full prefill reference")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    w = ReuseWorkload("rag", docs=args.docs, per_prompt=args.per_prompt, doc_len=args.doc_len,
                      question_len=args.question_len)
    need = max(batches) * (args.repeats + 1)
    tokens = args.per_prompt * args.doc_len + args.question_len
    llm = LLM(model=args.model, random_weights=True, max_num_seqs=max(batches), cuda_graph=False,
              max_num_batched_tokens=max(batches) * tokens, kv_memory=parse_size(args.kv_memory, "--kv-memory"), device=args.device)
    drawn = draw(w, need, llm.model_config.vocab_size, seed=0, reply_len=[1] * need)
    cfg, dev = llm.model_config, llm.device
    cuda = dev.type == "cuda"
    peak, bw = (measure_matmul_flops(), measure_copy_bandwidth()) if cuda else (float("nan"), float("nan"))
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * llm.dtype.itemsize
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.model} random weights, {name}, {llm.dtype}; prompts of {tokens} tokens; "
          f"bf16 GEMM {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s (measured)", flush=True)
    rows = []
    for flow in (["plain"] if not args.no_plain else []) + args.flows.split(","):
        llm.use_reuse(None if flow == "plain" else flow)
        if flow != "plain":
            llm.cache_segments(drawn.corpus)
        for b in batches:
            llm.engine.scheduler.max_num_batched_tokens = b * tokens  # the B prompts' rows: one step
            prompts = [drawn.layouts[i * b:(i + 1) * b] for i in range(args.repeats + 1)]
            _step(llm, prompts[0])  # warm-up: this batch's shapes compiled
            times, last = [], []
            for p in prompts[1:]:
                sync(dev)
                t0 = time.perf_counter()
                last = _step(llm, p)
                sync(dev)
                times.append(time.perf_counter() - t0)
            if flow != "plain" and llm.engine.stats.planned_batches[-1] != b:
                raise SystemExit(f"{flow}: {llm.engine.stats.planned_batches[-1]} reuse requests in the step, not {b}")
            _queue(llm, prompts[1])
            prof = profile_call(llm.engine.step, dev)
            while llm.engine.scheduler.has_work():
                llm.engine.step()
            stats = [s for _, s in last if s is not None]
            if stats:
                flops = sum(prefill_flops(cfg, s.token_layers, s.mlp_token_layers, s.attention_pairs) for s in stats)
                moved = 2 * sum(s.reused_tokens for s in stats) * kv_bytes_per_token  # read and written
            else:
                t = tokens
                flops = b * prefill_flops(cfg, cfg.num_hidden_layers * t, cfg.num_hidden_layers * t,
                                          cfg.num_hidden_layers * t * (t + 1) / 2)
                moved = 0
            step = statistics.median(times)
            floor = flops / peak + moved / bw
            cats = {k: v["ms"] for k, v in prof["categories"].items()}
            parts = prof["categories"].get("cache_update", {}).get("parts", {})
            row = {"flow": flow, "batch": b, "step_ms": round(step * 1e3, 2), "per_request_ms": round(step * 1e3 / b, 2),
                   "floor_ms": round(floor * 1e3, 2), "of_floor": round(floor / step, 3), "flops": flops,
                   "realign_bytes": moved, "profile_ms": cats, "cache_update_parts": parts,
                   "profile_sum_ms": prof["sum_ms"], "profile_wall_ms": prof["wall_ms"],
                   "compute_fraction": round(statistics.mean(s.compute_fraction for s in stats), 4) if stats else 1.0,
                   "recompute_ratio": round(statistics.mean(s.recompute_ratio for s in stats), 4) if stats else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| flow | B | step ms | per request ms | floor ms | % of floor | realign | selection | attention "
          "| GEMM | KV store | other |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, parts = r["profile_ms"], r["cache_update_parts"]
        known = parts.get("realign", 0.0) + c.get("indexer", 0.0) + c.get("topk", 0.0) + c.get("attention", 0.0) \
            + c.get("gemm", 0.0) + parts.get("kv store", 0.0)
        print(f"| {r['flow']} | {r['batch']} | {r['step_ms']:.1f} | {r['per_request_ms']:.1f} | {r['floor_ms']:.1f} | "
              f"{100 * r['of_floor']:.0f}% | {parts.get('realign', 0.0):.1f} | "
              f"{c.get('indexer', 0.0) + c.get('topk', 0.0):.1f} | {c.get('attention', 0.0):.1f} | {c.get('gemm', 0.0):.1f} | "
              f"{parts.get('kv store', 0.0):.1f} | {r['profile_sum_ms'] - known:.1f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "matmul_flops_per_s": peak, "copy_bytes_per_s": bw,
                                                   "prompt_tokens": tokens, "device": name},
                                                  indent=1))


if __name__ == "__main__":
    main()
