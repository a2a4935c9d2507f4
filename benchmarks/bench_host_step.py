"""Where a decode step's host time goes: the time the GPU waits between two graph replays.

`Engine.step` schedules, stages the inputs, launches the step's CUDA graph, then reads the sampled
tokens back (which waits for the GPU) and advances the sequences. Nothing of the next step starts
before that, so the host's part of every step is time the GPU sits idle. This times each part of
`llm.engine.step()` on the host clock over many steps (Qwen3-8B random weights, a decode batch of random
KV as `bench_engine.py` sets it up), beside the graph replay alone (CUDA events):

    python benchmarks/bench_host_step.py [--flows dense,block_topk] [--case 16x32768] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from sparsetune.engine.sequence import SamplingParams  # noqa: E402
from sparsetune.flow.params import parse_param_args  # noqa: E402
from sparsetune.llm import LLM  # noqa: E402
from sparsetune.perf.timing import time_calls  # noqa: E402


def timed(obj, name: str, log: dict[str, list[float]], key: str) -> None:
    """Wrap obj.name so that each call's host seconds are appended to log[key]."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            log.setdefault(key, []).append(time.perf_counter() - t)
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--flows", default="dense,block_topk")
    ap.add_argument("--param", action="append", default=["budget=2048", "dense_layers=0"])
    ap.add_argument("--case", default="16x32768")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    batch, ctx = (int(x) for x in args.case.split("x"))
    llm = LLM(model=args.model, random_weights=True, dtype="bfloat16", num_kv_blocks=batch * (ctx + 2 * args.steps + 64) // 16 + 64,
              max_num_seqs=batch, max_model_len=ctx + 2 * args.steps + 64, max_num_batched_tokens=ctx,
              cuda_graph_batch_sizes=(batch,))
    log: dict[str, list[float]] = {}
    timed(llm.engine.scheduler, "schedule", log, "schedule")
    timed(llm.engine.scheduler, "postprocess", log, "postprocess")
    timed(llm.engine.runner, "_replay", log, "stage inputs + launch graph")
    timed(llm, "_sample", log, "argmax + read tokens (waits for the GPU)")
    results = {"gpu": torch.cuda.get_device_name(), "case": args.case, "flows": {}}
    for flow in args.flows.split(","):
        if flow != "dense":
            llm.apply(llm.setup.with_flow(flow, parse_param_args(args.param)))
        seqs = []
        for _ in range(batch):
            s = llm.engine.reserve(torch.randint(0, 1000, (ctx,)).tolist(), SamplingParams(max_tokens=10**6, ignore_eos=True))
            llm.engine.admit_prefilled(s)
            seqs.append(s)
        for _ in range(5):
            llm.engine.step()
        log.clear()
        step = time_calls(llm.engine.step, llm.device, args.steps)  # each step: host clock, synchronised around it
        replay = time_calls(llm.engine.runner.graphs[batch].replay, llm.device, args.steps, events=True)
        for s in seqs:
            llm.engine.abort(s)
        row = {"step_ms": 1e3 * statistics.median(step), "graph_replay_ms": 1e3 * statistics.median(replay),
               "parts_ms": {k: 1e3 * statistics.median(v) for k, v in log.items()}}
        row["host_gap_ms"] = row["step_ms"] - row["graph_replay_ms"]
        results["flows"][flow] = row
        print(f"{flow} {args.case}: step {row['step_ms']:.3f} ms, graph replay {row['graph_replay_ms']:.3f} ms, "
              f"host gap {row['host_gap_ms']:.3f} ms; parts (median ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in row["parts_ms"].items()), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
