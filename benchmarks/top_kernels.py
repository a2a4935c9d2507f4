"""List the heaviest GPU kernels of one eager decode step of a flow (for indexer work).

    python benchmarks/top_kernels.py --flow quest --batch 16 --context 32768 --param budget=2048

The requests come in through the engine's API as if prefilled (`reserve` + `admit_prefilled` over a
pool of random KV); the profiled call is one `LLM.step()` (runner, sampling, scheduling).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from sparsetune.llm import LLM
from sparsetune.engine.sequence import SamplingParams
from sparsetune.flow.params import parse_param_args
from sparsetune.perf.timing import sync


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--flow", default="quest")
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    blocks = a.batch * (a.context // 16 + 2) + 64
    llm = LLM(model=a.model, random_weights=True, num_kv_blocks=blocks, max_num_seqs=a.batch, cuda_graph=False,
              max_model_len=a.context + 64, flow=a.flow, params=parse_param_args(a.param))
    for layer in range(llm.engine.kv.num_layers):
        llm.engine.kv.k[layer].normal_()
        llm.engine.kv.v[layer].normal_()
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    seqs = []
    for _ in range(a.batch):  # the pool holds (random) KV for every earlier position
        s = llm.engine.reserve(torch.randint(0, 1000, (a.context,)).tolist(), params)
        llm.engine.admit_prefilled(s)  # its first decode step computes the last prompt token
        seqs.append(s)
    try:
        for _ in range(2):
            llm.engine.step()
        sync(llm.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.engine.step()
            sync(llm.device)
    finally:
        for s in seqs:
            llm.engine.abort(s)
    rows = sorted(
        ((ev.key, ev.device_time_total / 1e3, ev.count) for ev in prof.key_averages() if ev.device_time_total > 0),
        key=lambda r: -r[1],
    )
    for name, ms, n in rows[: a.top]:
        print(f"{ms:8.3f} ms  {n:5d}x  {name[:110]}")


if __name__ == "__main__":
    main()
