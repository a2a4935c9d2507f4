"""Time to first token of a long prompt with reused segments, through a live SGLang server (issue #44, item 4).

    python benchmarks/sglang_reuse.py --mode full|prefix|reuse --label L --json-out F \
        [--url http://127.0.0.1:30000] [--server-pid PID] [--context 32768] [--segments 9] [--repeats 3]

The prompt is `bench_reuse.py`'s (`perf.speed.reuse_prompt`: a plain prefix, `--segments` reusable
segments holding 90% of the text, a plain question; one token per character with the stand-in byte
tokenizer SGLang is launched with for random weights). Each timed request is one `/generate` call
with `max_new_tokens=1`, greedy: its latency at the client is the time to first token (HTTP and
tokenization included). The modes:

- `full`: SGLang's own prefill of the whole prompt. Every request has a prefix text of its own, so
  SGLang's prefix cache finds none of it.
- `prefix`: SGLang's prefix cache as a RAG server has it: a first request holds the prompt, then
  each timed one has the same prefix and first segment and the other segments in another order
  (rotated by one more each time), so the cache finds the prefix and the first segment only.
- `reuse`: the parts go in `custom_params.sparsetune_parts` (README, "Reuse flows in SGLang"), to a
  server with a reuse bundle. A first request stores the segments (the server sends each as a
  request of its own first); each timed one has a prefix of its own (as in `full`, and as
  `bench_reuse.py` computes it on the engine), so what it skips is what the flow reuses.

One warm-up request precedes the timed ones (kernels' first launch). Each row written holds the
median, every request's seconds and SGLang's `meta_info` of the last one (prompt and cached tokens),
and SGLang's own `e2e_latency` of each (`server_s`: from the request's admission by its tokenizer
manager, so without HTTP, and, for a request with parts, without the hook's encoding and the
segments' fill requests that precede it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_parity import joined, post, wait_ready  # noqa: E402

from sparsetune.export.sglang.segments import FIELD  # noqa: E402
from sparsetune.perf.speed import reuse_prompt  # noqa: E402


def prompts(mode: str, context: int, ratio: float, segments: int, count: int) -> tuple[list, list[list]]:
    """The first (cache-building) request's parts, and `count` more in order."""
    base = reuse_prompt(context, ratio, segments)
    fresh = [[reuse_prompt(context, ratio, segments, seed=1000 + i)[0], *base[1:]] for i in range(count + 1)]
    if mode == "prefix":  # same prefix and first segment; the rest rotated
        head, rest, tail = base[:2], base[2:-1], base[-1:]
        return base, [head + rest[i % len(rest):] + rest[: i % len(rest)] + tail for i in range(1, count + 1)]
    return fresh[0], fresh[1:]


def request(url: str, parts: list, mode: str) -> tuple[float, dict]:
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    if mode == "reuse":
        sp["custom_params"] = {FIELD: json.dumps(parts)}
    t0 = time.perf_counter()
    (out,) = post(url, {"text": joined(parts), "sampling_params": sp})
    return time.perf_counter() - t0, out.get("meta_info", {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["full", "prefix", "reuse"])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--server-pid", type=int)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--reuse-ratio", type=float, default=0.9)
    ap.add_argument("--segments", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", required=True)
    ap.add_argument("--json-out", required=True)
    args = ap.parse_args()

    wait_ready(args.url, 600, args.server_pid)
    first, rest = prompts(args.mode, args.context, args.reuse_ratio, args.segments, 1 + args.repeats)
    s0, meta0 = request(args.url, first, args.mode)
    print(f"{args.label}: first request {s0:.3f} s ({meta0.get('prompt_tokens')} tokens, "
          f"{meta0.get('cached_tokens')} cached)", flush=True)
    request(args.url, rest[0], args.mode)  # warm-up
    runs = [request(args.url, p, args.mode) for p in rest[1:]]
    seconds = [s for s, _ in runs]
    server = [m.get("e2e_latency") for _, m in runs]
    meta = runs[-1][1]
    row = {"label": args.label, "mode": args.mode, "ttft_s": statistics.median(seconds), "runs_s": seconds,
           "server_s": statistics.median(server) if None not in server else None, "runs_server_s": server,
           "first_s": s0, "context": args.context, "segments": args.segments, "reuse_ratio": args.reuse_ratio,
           "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens"), "meta_info": meta}
    with open(args.json_out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{args.label}: TTFT {row['ttft_s']:.3f} s (median of {len(seconds)}: "
          f"{', '.join(f'{s:.3f}' for s in seconds)}; SGLang's e2e_latency {row['server_s']}), "
          f"{row['prompt_tokens']} tokens, {row['cached_tokens']} cached", flush=True)


if __name__ == "__main__":
    main()
