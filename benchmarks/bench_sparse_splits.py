"""Split counts of the sparse decode attention kernel by shape, on a GPU: is `choose_num_splits`'s pick
the fastest where the batch is large?

Vortex's offline setting on Qwen3-1.7B shapes runs 53 sequences x 8 KV heads = 424 (sequence, KV head)
rows on an H200. The rule's 4 programs per SM, rounded down, gave them one split: 206 us against
162 at two on an H100 (72% and 92% of the byte floor, BENCHMARKS.md "Vortex's setting on an H100"),
so rows short of 4 per SM now get at least two. Each shape here is timed at every split
count in `SPLITS` (a CUDA-graph median of one call, inputs rotated over `--rotate` copies so that L2
holds none of them), beside the bytes it must read at the measured copy bandwidth; the rule's pick
is marked.

    python benchmarks/bench_sparse_splits.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import bench_us, measure_copy_bandwidth, rotating, sparse_decode_inputs  # noqa: E402

from sparsetune.kernels.limits import num_sms  # noqa: E402
from sparsetune.kernels.paged_decode import (choose_num_splits, sparse_paged_decode_attention,  # noqa: E402
                                             sparse_paged_decode_attention_ref)

# name: (batch, query heads, KV heads, head dim, page, selected units, unit tokens, context)
SHAPES = {
    "qwen3-1.7b vortex (53 x 2,048 of 12K)": (53, 16, 8, 128, 16, 128, 16, 12288),
    "qwen3-1.7b vortex (51 x 2,048 of 12K)": (51, 16, 8, 128, 16, 128, 16, 12288),
    "qwen3-8b vortex-like (32 x 2,048 of 12K)": (32, 32, 8, 128, 16, 128, 16, 12288),
    "qwen3-8b 16 x 32K at 1/8 (4,096)": (16, 32, 8, 128, 16, 256, 16, 32768),
    "qwen3-8b 16 x 32K, 2-token units (4,096)": (16, 32, 8, 128, 16, 2048, 2, 32768),
    "qwen3-8b 8 x 32K, 2,048": (8, 32, 8, 128, 16, 128, 16, 32768),
}
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16]


def shape_point(name: str, shape: tuple, rotate: int, gen: torch.Generator, copy_tb_s: float) -> dict:
    batch, hq, hkv, d, page, k_sel, unit, ctx = shape
    q, k, v, bt, lens, sels, counts = sparse_decode_inputs(batch, hq, hkv, d, page, k_sel, unit, ctx, rotate, gen,
                                                           spare_blocks=8)
    scale = d**-0.5
    kv_bytes = batch * hkv * k_sel * unit * d * 2 * 2
    floor_us = kv_bytes / (copy_tb_s * 1e12) * 1e6
    pick = choose_num_splits(batch, hkv, k_sel, unit, num_sms(q.device), sparse=True)
    out = torch.empty_like(q)
    ref = sparse_paged_decode_attention_ref(q, k, v, bt, lens, sels[0], counts, scale, unit=unit)
    row: dict = {"shape": name, "batch": batch, "q_heads": hq, "kv_heads": hkv, "selected_tokens": k_sel * unit,
                 "unit": unit, "kv_mb": kv_bytes / 1e6, "floor_us": floor_us, "rule_splits": pick, "us": {}}
    for splits in SPLITS:
        if splits * 128 > k_sel * unit and splits != 1:
            continue
        sparse_paged_decode_attention(q, k, v, bt, lens, sels[0], counts, scale, unit=unit, num_splits=splits, out=out)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        if not err < 1e-2:
            raise SystemExit(f"{name} splits {splits}: relative error {err:.2e}")
        us = bench_us(rotating([lambda s=s: sparse_paged_decode_attention(q, k, v, bt, lens, s, counts, scale, unit=unit,
                                                                          num_splits=splits, out=out) for s in sels]))
        row["us"][splits] = us
        mark = "  <- rule" if splits == pick else ""
        print(f"  {name:44s} splits {splits:2d}: {us:7.1f} us, {floor_us / us:5.1%} of the byte floor "
              f"({floor_us:.1f} us){mark}")
    best = min(row["us"], key=row["us"].get)
    row["best_splits"] = best
    print(f"  -> best {best} splits ({row['us'][best]:.1f} us); the rule's {pick}: {row['us'].get(pick, float('nan')):.1f} us")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rotate", type=int, default=3, help="input copies cycled through (defeats L2 reuse)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = measure_copy_bandwidth(1.0) / 1e12
    res: dict = {"device": torch.cuda.get_device_name(), "sms": num_sms(torch.device("cuda")), "copy_tb_s": copy, "rows": []}
    for name, shape in SHAPES.items():
        res["rows"].append(shape_point(name, shape, args.rotate, gen, copy))
        torch.cuda.empty_cache()  # the shape's cache, gone with its frame
    print(f"{res['device']}: copy {copy:.2f} TB/s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
