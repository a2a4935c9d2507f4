#!/usr/bin/env python
"""Attention of a reuse plan's recomputed rows at 32K (issue #18, item 1): the rows kernel vs today's path.

    python benchmarks/bench_rows_attention.py [--context 32768] [--budgets 0.05,0.15] [--dtype bfloat16]

Qwen3-8B attention shapes (32 query / 8 KV heads, head dim 128), one layer. The row set is what a
reuse plan at 90% reused recomputes past its selection layer: the 10% of the prompt that is fresh
(consecutive, the end of the prompt) plus `budget` of the reused tokens scattered through the rest
(random, sorted). For each budget it times:
  - `today`: `engine.rows.attend_causal` (cuDNN/flash causal calls for runs of >= 64 consecutive
    rows, one masked SDPA call over keys 0..max for the scattered rest), on the gathered `[Hkv, T, D]` KV;
  - `rows`: `kernels.rows_attention` on the same contiguous KV (through tensor descriptors on
    Hopper; `rows_pointers`: pointer loads), and on the paged pool (block 16,
    shuffled table: no gather needed), and `rows_gather`: the pool's pages gathered to contiguous
    K and V first (`kernels.kv_store.gather_kv`, what `KVCache.gather` runs on CUDA, timed alone as
    `gather`; its torch twin's index_select as `gather_index_select`), then the contiguous kernel;
  - `causal_all`: causal attention of every row of the prompt (full recompute's attention);
and the floor: the FLOPs the rows need (4 * D * Hq * sum(pos + 1)) / the measured matmul rate.
Checks the outputs agree (max abs difference against `today`).
Then RedKnot's pattern (issue #18, item 2): every row of the prompt, `--global-heads` of the KV heads
global, the rest local (sinks + window): `engine.rows.attend_pattern` (masked SDPA in chunks of rows,
today's path) vs the rows kernel with per-head sinks and windows, against the FLOPs the pattern needs.
Then LoopServe's (item 2): the last `--fresh` of the prompt's rows, each query head with vertical
lines (`--vertical` of the keys and the first 4) and slash lines (`--slash` of the distances and the
first 64): `attend_pattern` vs `kernels.rows_attention.lines_attention` (block-sparse tile lists).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import bench_us, measure_matmul_flops  # noqa: E402

from sparsetune.engine.attention import causal_sdpa, prefill_backends  # noqa: E402
from sparsetune.kernels.kv_store import gather_kv, gather_kv_ref  # noqa: E402
from sparsetune.engine.rows import CausalRuns, HeadWindows, Lines, attend_causal, attend_pattern  # noqa: E402
from sparsetune.kernels.rows_attention import line_blocks, lines_attention, rows_attention  # noqa: E402


def row_set(t: int, fresh: float, budget: float, gen: torch.Generator) -> torch.Tensor:
    reused = int(t * (1 - fresh))
    picked = torch.randperm(reused, generator=gen)[: int(reused * budget)].sort().values
    return torch.cat([picked, torch.arange(reused, t)]).cuda()


def sweep(qa, k, v, scale, pos, peak, d, hq) -> None:
    """The row kernel's tile configs (rows per program, keys per tile, warps, stages) on one row set,
    contiguous through tensor descriptors (what the engine runs) and through pointers, fastest first."""
    q = qa[pos]
    flops = 4 * d * hq * float((pos + 1).sum())
    out = []
    for bm in (16, 32, 64):
        for bn in (16, 32, 64, 128):
            for w in (4, 8):
                for st in (2, 3, 4):
                    kw = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                    try:
                        us = {"rows": bench_us(lambda: rows_attention(q, pos, k, v, scale, **kw)),
                              "rows_pointers": bench_us(lambda: rows_attention(q, pos, k, v, scale, tma=False, **kw))}
                    except Exception as e:  # out of shared memory and the like
                        print(f"  {kw}: {type(e).__name__}", flush=True)
                        continue
                    rec = {"kernel": kw, "us": {n: round(x, 1) for n, x in us.items()},
                           "of_peak": {n: round(flops / x * 1e6 / peak, 3) for n, x in us.items()}}
                    out.append(rec)
                    print(json.dumps(rec), flush=True)
    for rec in sorted(out, key=lambda r: r["us"]["rows"])[:8]:
        print("best:", json.dumps(rec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budgets", default="0.05,0.15")
    ap.add_argument("--fresh", type=float, default=0.10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-m", type=int, default=0, help="rows per program (0: the kernel's default)")
    ap.add_argument("--block-n", type=int, default=0, help="keys per tile (0: the kernel's default)")
    ap.add_argument("--num-warps", type=int, default=0)
    ap.add_argument("--num-stages", type=int, default=0)
    ap.add_argument("--global-heads", type=int, default=1, help="RedKnot case: global KV heads of 8 (15%%: 1)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--vertical", type=float, default=0.02)
    ap.add_argument("--slash", type=float, default=0.01)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--sweep", action="store_true",
                    help="time the scattered rows (first budget; contiguous, descriptors and pointers) over a grid of tile configs, then exit")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    t, hq, hkv, d, bs = a.context, 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(hkv, t, d, generator=gen).to("cuda", dt)
    v = torch.randn(hkv, t, d, generator=gen).to("cuda", dt)
    nb = t // bs
    table = torch.randperm(nb, generator=gen).to("cuda", torch.int32)
    kp = torch.empty(nb, hkv, bs, d, device="cuda", dtype=dt)
    vp = torch.empty_like(kp)
    kp[table.long()] = k.view(hkv, nb, bs, d).transpose(0, 1)
    vp[table.long()] = v.view(hkv, nb, bs, d).transpose(0, 1)
    ids = table.long()

    def gathered():
        return gather_kv(kp, vp, ids, t)

    peak = measure_matmul_flops()
    scale = d**-0.5
    kw = dict(block_m=a.block_m or None, block_n=a.block_n or None, num_warps=a.num_warps or None,
              num_stages=a.num_stages or None)
    results = []
    qa = torch.randn(t, hq, d, generator=gen).to("cuda", dt)
    with prefill_backends():
        causal_us = bench_us(lambda: causal_sdpa(qa.transpose(0, 1), k, v, 0, scale), use_graph=False)
    causal_flops = 4 * d * hq * t * (t + 1) / 2
    if a.sweep:
        sweep(qa, k, v, scale, row_set(t, a.fresh, float(a.budgets.split(",")[0]), gen), peak, d, hq)
        return
    for budget in (float(x) for x in a.budgets.split(",")):
        pos = row_set(t, a.fresh, budget, gen)
        q = qa[pos]
        runs = CausalRuns.of(pos)
        flops = 4 * d * hq * float((pos + 1).sum())
        today = attend_causal(q, pos, k, v, runs, scale)
        got = rows_attention(q, pos, k, v, scale, **kw)
        got_paged = rows_attention(q, pos, kp, vp, scale, block_table=table, **kw)
        diff = max(float((got.float() - today.float()).abs().max()), float((got_paged.float() - today.float()).abs().max()))
        us = {
            "today": bench_us(lambda: attend_causal(q, pos, k, v, runs, scale), use_graph=False),
            "rows": bench_us(lambda: rows_attention(q, pos, k, v, scale, **kw)),
            "rows_pointers": bench_us(lambda: rows_attention(q, pos, k, v, scale, tma=False, **kw)),
            "rows_paged": bench_us(lambda: rows_attention(q, pos, kp, vp, scale, block_table=table, **kw)),
            "rows_gather": bench_us(lambda: rows_attention(q, pos, *gathered(), scale, **kw)),
            "gather": bench_us(gathered),
            "gather_index_select": bench_us(lambda: gather_kv_ref(kp, vp, ids, t)),
        }
        rec = {"context": t, "budget": budget, "fresh": a.fresh, "rows": int(pos.numel()), "dtype": a.dtype,
               "us": {n: round(x, 1) for n, x in us.items()}, "floor_us": round(flops / peak * 1e6, 1),
               "tflops": {n: round(flops / x / 1e6, 1) for n, x in us.items()},
               "of_peak": {n: round(flops / x * 1e6 / peak, 3) for n, x in us.items()},
               "causal_all_us": round(causal_us, 1), "causal_all_tflops": round(causal_flops / causal_us / 1e6, 1),
               "max_abs_diff_vs_today": diff, "kernel": kw, "peak_tflops": round(peak / 1e12, 1)}
        results.append(rec)
        print(json.dumps(rec))
    # RedKnot: every row, global heads causal, local heads sinks + window
    pos = torch.arange(t, device="cuda")
    sinks = torch.tensor([0] * a.global_heads + [a.sink] * (hkv - a.global_heads), dtype=torch.int32, device="cuda")
    wins = torch.tensor([t] * a.global_heads + [a.window] * (hkv - a.global_heads), dtype=torch.int32, device="cuda")
    keys = torch.arange(t, device="cuda")
    allowed = HeadWindows(sinks, wins, hq // hkv, t)  # RedKnot's pattern as its attention_pattern returns it

    seen = sum(min(i + 1, a.window) + min(a.sink, max(0, i + 1 - a.window)) for i in range(t))  # a local head's keys
    flops = 4 * d * (hq // hkv) * (a.global_heads * t * (t + 1) / 2 + (hkv - a.global_heads) * seen)
    today = attend_pattern(qa, pos, k, v, allowed, scale)
    got = rows_attention(qa, pos, k, v, scale, sinks=sinks, windows=wins, **kw)
    us = {"today": bench_us(lambda: attend_pattern(qa, pos, k, v, allowed, scale), use_graph=False),
          "rows": bench_us(lambda: rows_attention(qa, pos, k, v, scale, sinks=sinks, windows=wins, **kw)),
          "rows_pointers": bench_us(lambda: rows_attention(qa, pos, k, v, scale, sinks=sinks, windows=wins, tma=False, **kw))}
    rec = {"case": "redknot", "context": t, "global_kv_heads": a.global_heads, "window": a.window, "sink": a.sink,
           "us": {n: round(x, 1) for n, x in us.items()}, "floor_us": round(flops / peak * 1e6, 1),
           "of_peak": {n: round(flops / x * 1e6 / peak, 3) for n, x in us.items()},
           "causal_all_us": round(causal_us, 1), "max_abs_diff_vs_today": float((got.float() - today.float()).abs().max())}
    results.append(rec)
    print(json.dumps(rec))
    # LoopServe: the fresh rows at the end, per query head vertical + slash lines
    pos = torch.arange(int(t * (1 - a.fresh)), t, device="cuda")
    vertical = torch.rand(hq, t, generator=gen) < a.vertical
    vertical[:, :4] = True
    slash = torch.rand(hq, t, generator=gen) < a.slash
    slash[:, :64] = True
    vertical, slash = vertical.cuda(), slash.cuda()

    lines = Lines(vertical, slash)  # LoopServe's pattern as its attention_pattern returns it

    seen = ((lines(pos) & (keys[None, None] <= pos[None, :, None])) | (keys[None, None] == pos[None, :, None])).sum()
    flops = 4 * d * float(seen)
    q = qa[pos]
    today = attend_pattern(q, pos, k, v, lines, scale)
    kw = {n: x for n, x in kw.items() if x}  # lines_attention's defaults are numbers
    got = lines_attention(q, pos, k, v, scale, vertical, slash, **kw)
    got_paged = lines_attention(q, pos, kp, vp, scale, vertical, slash, block_table=table, **kw)
    diff = max(float((got.float() - today.float()).abs().max()), float((got_paged.float() - today.float()).abs().max()))
    bm, bn = a.block_m or 64, a.block_n or 64  # lines_attention's default tiles
    blocks, counts = line_blocks(pos, vertical, slash, bm, bn)
    us = {"today": bench_us(lambda: attend_pattern(q, pos, k, v, lines, scale), use_graph=False),
          "lines": bench_us(lambda: lines_attention(q, pos, k, v, scale, vertical, slash, **kw)),
          "lines_pointers": bench_us(lambda: lines_attention(q, pos, k, v, scale, vertical, slash, tma=False, **kw)),
          "lines_paged": bench_us(lambda: lines_attention(q, pos, kp, vp, scale, vertical, slash, block_table=table, **kw)),
          "lines_gather": bench_us(lambda: lines_attention(q, pos, *gathered(), scale, vertical, slash, **kw)),
          "line_blocks": bench_us(lambda: line_blocks(pos, vertical, slash, bm, bn))}
    rec = {"case": "loopserve", "context": t, "rows": int(pos.numel()), "vertical": a.vertical, "slash": a.slash,
           "tiles_read": round(float(counts.sum()) / counts.numel() / blocks.shape[2], 3),
           "us": {n: round(x, 1) for n, x in us.items()}, "floor_us": round(flops / peak * 1e6, 1),
           "max_abs_diff_vs_today": diff}
    results.append(rec)
    print(json.dumps(rec))
    if a.json_out:
        a.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
