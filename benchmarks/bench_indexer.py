#!/usr/bin/env python
"""One layer's block selection at decode: Inductor path vs the generated indexer + radix top-k.

    python benchmarks/bench_indexer.py [--flows block_topk,quest] [--cases 16x32768,8x32768]
    python benchmarks/bench_indexer.py --flows double_sparse_centroid --cases 28x12288 --group 2 --max-tiles 16,1 --scoring-only

Qwen3-8B attention shapes (32 query / 8 KV heads, head dim 128, bf16, blocks of 16), one
layer's KV pool filled with random keys, the flow's cache-stage fields computed over every
block, shuffled block tables; budget 2048 tokens. For each flow and (batch, context) it times,
under CUDA graph replay:
  - `inductor`: the compiled executor's Inductor path (gather, stages, torch.topk);
  - `generated`: the generated indexer kernel + the radix-select top-k kernel;
  - their parts (scoring kernel alone, radix select alone, torch.topk on the same scores);
and the floor: the cached-field bytes the indexer must read / measured copy bandwidth.
`--group 2`: Qwen3-1.7B's group (16 query heads); `--max-tiles`: sweep how many tiles a program of a
tiled kernel (costly row math of its own, e.g. DoubleSparse's projected query) may loop over (`indexer.MAX_TILES`; 1:
a program a tile, as untiled kernels run); `--scoring-only`: the generated scoring kernel alone.
It also reports how often both paths choose the same blocks (they score in different
precisions: Inductor in the field dtype, the generated kernel in fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import bench_us, measure_copy_bandwidth  # noqa: E402

from sparsetune.engine.kv_cache import KVCache  # noqa: E402
from sparsetune.models.artifacts import synthetic_calibration  # noqa: E402
from sparsetune.flow.compile import PagedBlocks, build_indexer  # noqa: E402
from sparsetune.flow.compile import indexer as indexer_mod  # noqa: E402
from sparsetune.loader import build_flow  # noqa: E402
from sparsetune.flow.attention import FlowAttention  # noqa: E402
from sparsetune.kernels import select_topk as topk_mod  # noqa: E402
from sparsetune.kernels.select_topk import select_topk  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def case(flow_name: str, batch: int, ctx: int, budget: int, bw: float, extra: int, sweep: bool = True,
         group: int = HQ // HKV, scoring_only: bool = False) -> dict:
    hq = group * HKV
    flow = build_flow(flow_name, {"budget": str(budget), "dense_layers": ""})
    nb = -(-ctx // BS)
    kv = KVCache(1, batch * (nb + extra) + 1, HKV, BS, D, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    # The engine's tables are wider than the context (room to generate): `extra` more columns.
    bt = torch.randperm(batch * (nb + extra), device="cuda").view(batch, nb + extra).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, D, dtype=torch.bfloat16, device="cuda")
    calib = synthetic_calibration(1, HKV, D) if flow.calibrated else None
    attn = FlowAttention(flow, D**-0.5, executor="compiled", calibration=calib)
    const = attn.constants(0, kv)
    attn.run_cache(0, kv, bt[:, :nb].flatten().long(), bt[:, :nb].flatten().long())
    stores = attn.fields[0]
    dims = {n: tuple(t.shape[2:]) for n, t in stores.items()}
    ker = build_indexer(flow, group, D)
    k_max = min(nb + extra, flow.budget_blocks(nb + extra))
    rule = attn.rule(q.device)

    def inductor():  # the compiled torch indexer + torch.topk (what runs for non-block-local flows)
        return attn.stages.select_fn(q, bt, seq_lens, stores, None, HKV, BS, kv.null_block, const, rule, k_max)[0]

    def scores():
        return ker(q, PagedBlocks(bt, kv.null_block), seq_lens, stores, None, const, HKV, rule)

    sc, counts = scores()
    block_s = ker.tile(q, stores)[0]
    field_bytes = batch * HKV * nb * sum(2 * r * c for r, c in dims.values())
    floor_us = 1e6 * field_bytes / bw
    if scoring_only:
        return {"flow": flow_name, "batch": batch, "context": ctx, "group": group, "block_s": block_s,
                "tiles": ker.tiles(batch * HKV, -(-sc.shape[1] // block_s), q.device),
                "us": {"scoring": bench_us(scores)}, "field_bytes": field_bytes, "floor_us": floor_us}

    def generated():
        return select_topk(*scores(), k_max)

    t = {
        "inductor": bench_us(inductor),
        "generated": bench_us(generated),
        "scoring": bench_us(scores),
        "radix_select": bench_us(lambda: select_topk(sc, counts, k_max)),
        "torch_topk": bench_us(lambda: sc.topk(k_max, dim=1)),
    }
    if sweep:
        t.update(topk_sweep(sc, counts, k_max))
    a = inductor().view(batch, HKV, k_max)
    b = generated().view(batch, HKV, k_max)
    same = sum(
        len(set(a[i, h].tolist()) & set(b[i, h].tolist())) for i in range(batch) for h in range(HKV)
    ) / (batch * HKV * k_max)
    return {"flow": flow_name, "batch": batch, "context": ctx, "group": group, "block_s": block_s, "us": t,
            "field_bytes": field_bytes, "floor_us": floor_us, "same_blocks": same}


def topk_sweep(sc: torch.Tensor, counts: torch.Tensor, k_max: int) -> dict[str, float]:
    """The radix select alone at each pass width and warp count, each checked against the default's
    selection (the defaults restored after)."""
    default = select_topk(sc, counts, k_max)
    warps0, bits0, t = topk_mod.NUM_WARPS, topk_mod.PASS_BITS, {}
    try:
        for bits in (1, 2):
            for warps in (4, 8, 16, 32):
                topk_mod.NUM_WARPS, topk_mod.PASS_BITS = warps, bits
                if not torch.equal(select_topk(sc, counts, k_max), default):
                    raise SystemExit(f"select_topk at {bits}-bit passes, {warps} warps differs from the default")
                t[f"radix{bits}_w{warps}"] = bench_us(lambda: select_topk(sc, counts, k_max))
    finally:
        topk_mod.NUM_WARPS, topk_mod.PASS_BITS = warps0, bits0
    return t


def topk_widths(widths: list[int], rows: int, budget: int, block_sizes: list[int], baseline: str,
                json_out: str = "") -> list[dict]:
    """The top-k alone on rows as wide as a 32K sequence's blocks at each block size: the engine's
    scores (random here) with its ten table columns past the context at -inf and the first and
    last blocks forced (+inf), k = budget / block size; against torch.topk and, if given, another
    select_topk module (`--topk-baseline`, e.g. an earlier version of the file). Each block size's
    sweep compiles 8 variants: `json_out` is rewritten after each, so a step cut short keeps its part."""
    base = None
    if baseline:
        import importlib.util
        spec = importlib.util.spec_from_file_location("baseline_topk", baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    out = []
    for width, bs in zip(widths, block_sizes):
        k = budget // bs
        sc = torch.randn(rows, width + 10, device="cuda")
        sc[:, width:] = float("-inf")
        sc[:, :2] = float("inf")
        counts = torch.full((rows,), k, dtype=torch.int32, device="cuda")
        ref = topk_mod.select_topk_ref(sc, counts, k)
        assert torch.equal(select_topk(sc, counts, k), ref), "select_topk differs from its torch twin"
        t = {"default": bench_us(lambda: select_topk(sc, counts, k)), "torch_topk": bench_us(lambda: sc.topk(k, dim=1))}
        if base is not None:
            assert torch.equal(base.select_topk(sc, counts, k), ref)
            t["baseline"] = bench_us(lambda: base.select_topk(sc, counts, k))
        t.update(topk_sweep(sc, counts, k))
        out.append({"rows": rows, "width": width + 10, "k": k, "block_size": bs, "us": t})
        print(f"top-k {rows} rows x {width + 10} (block {bs}, k {k}): " + ", ".join(f"{a} {b:.1f}" for a, b in t.items()) + " us")
        if json_out:
            Path(json_out).write_text(json.dumps({"topk": out}, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flows", default="block_topk,quest")
    ap.add_argument("--cases", default="16x32768,8x32768")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--table-extra", type=int, default=10, help="block-table columns past the context (engine: ~10)")
    ap.add_argument("--elems", default="", help="sweep the generator's per-program element budget, e.g. 4096,16384")
    ap.add_argument("--topk-block-sizes", default="", help="only the top-k alone, rows of a 32K context at these "
                    "block sizes, e.g. 2,4,8,16 (16 x 8 rows: batch 16, 8 KV heads)")
    ap.add_argument("--topk-baseline", default="", help="a select_topk module file to time beside it")
    ap.add_argument("--warps", default="", help="sweep the generated indexer's warps per program, e.g. 4,8")
    ap.add_argument("--no-topk-sweep", action="store_true", help="skip the radix select's warp/pass sweep")
    ap.add_argument("--dot", default="on", choices=("on", "off", "both"),
                    help="the tensor-core form of centroid-times-query products (indexer.DOT_PRODUCTS)")
    ap.add_argument("--group", type=int, default=HQ // HKV, help="query heads per KV head (8 KV heads; 2: Qwen3-1.7B)")
    ap.add_argument("--max-tiles", default="", help="sweep indexer.MAX_TILES (tiles a tiled kernel's program loops over), e.g. 16,1")
    ap.add_argument("--scoring-only", action="store_true", help="time the generated scoring kernel alone")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.topk_block_sizes:
        sizes = [int(x) for x in args.topk_block_sizes.split(",")]
        topk_widths([32768 // b for b in sizes], 128, args.budget, sizes, args.topk_baseline, args.json_out)
        return
    bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    sweep = [int(x) for x in args.elems.split(",") if x] or [indexer_mod.ELEMS_PER_PROGRAM]
    warps = [int(x) for x in args.warps.split(",") if x] or [indexer_mod.NUM_WARPS]
    dots = {"on": [True], "off": [False], "both": [True, False]}[args.dot]
    max_tiles = [int(x) for x in args.max_tiles.split(",") if x] or [indexer_mod.MAX_TILES]
    for name, elems, w, dot, mt in [(f, e, w, d, m) for f in args.flows.split(",") for e in sweep for w in warps
                                    for d in dots for m in max_tiles]:
        indexer_mod.ELEMS_PER_PROGRAM, indexer_mod.NUM_WARPS, indexer_mod.DOT_PRODUCTS = elems, w, dot
        indexer_mod.MAX_TILES = mt
        print(f"-- ELEMS_PER_PROGRAM {elems}, {w} warps, tensor-core products {'on' if dot else 'off'}, "
              f"MAX_TILES {mt}", flush=True)
        for c in args.cases.split(","):
            b, n = (int(x) for x in c.split("x"))
            r = case(name, b, n, args.budget, bw, args.table_extra, not args.no_topk_sweep, args.group, args.scoring_only)
            r["dot_products"], r["max_tiles"] = dot, mt
            rows.append(r)
            t = r["us"]
            if args.scoring_only:
                print(f"{name:11s} {b:3d}x{n:<6d} group {args.group} scoring {t['scoring']:6.1f} us | field floor "
                      f"{r['floor_us']:5.1f} us, at {100 * r['floor_us'] / t['scoring']:4.0f}% | BLOCK_S {r['block_s']}, "
                      f"tiles {r['tiles']}", flush=True)
                continue
            print(f"{name:11s} {b:3d}x{n:<6d} inductor {t['inductor']:7.1f} us | generated {t['generated']:6.1f} us "
                  f"(scoring {t['scoring']:5.1f}, radix select {t['radix_select']:5.1f}; torch.topk {t['torch_topk']:5.1f}) "
                  f"| field floor {r['floor_us']:5.1f} us, scoring at {100 * r['floor_us'] / t['scoring']:4.0f}% "
                  f"| BLOCK_S {r['block_s']} | same blocks {100 * r['same_blocks']:.1f}%")
            print("   radix select sweep: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items() if k.startswith("radix")))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
