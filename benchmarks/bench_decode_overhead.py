"""Where a sparse decode attention call's time goes beyond its bytes (#17 item 1, batch 8), on a GPU.

Three measurements, each a CUDA-graph median (`common.bench_us`) with the inputs rotated over
`--rotate` copies so that no call finds the last one's bytes in L2 (as in the engine, where every
layer reads other KV):

1. The read floor by size: a Triton kernel that only streams N bytes (each program sums a
   contiguous chunk), for N from 16 MB to 1 GB. A kernel of ~67 MB (the K/V that 2,048 selected
   tokens of 8 sequences x 8 KV heads read) cannot run at the 1 GB rate: the ramp, the one wave's
   tail and the launch are a fixed cost.
2. The sparse decode kernel (`sparse_paged_decode_attention`, Qwen3-8B shapes, block 16, 128 random
   blocks per (sequence, KV head)) at batch 8 and 16 x 32K over tile configs and split counts: the
   whole call, and stage 1 alone (the merge kernel skipped).
3. One empty Triton kernel per call: the cost of a kernel boundary inside a graph.

    python benchmarks/bench_decode_overhead.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import bench_us, measure_copy_bandwidth, rotating, sparse_decode_inputs  # noqa: E402

from sparsetune.kernels import paged_decode  # noqa: E402
from sparsetune.kernels.paged_decode import sparse_paged_decode_attention, sparse_paged_decode_attention_ref  # noqa: E402

HQ, HKV, HEAD_DIM, BLOCK_SIZE, K_SEL, CTX = 32, 8, 128, 16, 128, 32768
# (block_n, num_warps, num_stages) and split counts swept (the library default: 64, 4, 3).
CONFIGS = [(64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 4), (32, 2, 3), (16, 2, 3), (128, 8, 3)]
SPLITS = [4, 8, 16, 32]


@triton.jit
def _read_kernel(x_ptr, out_ptr, chunk, BLOCK: tl.constexpr):
    """Program p sums elements [p * chunk, (p + 1) * chunk) of x (chunk a multiple of BLOCK)."""
    base = x_ptr + tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, chunk, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _empty_kernel(x_ptr):
    pass


def read_floor(rotate: int) -> list[dict]:
    rows = []
    block = 4096  # bf16 elements a load: 8 KB
    for mb in (16, 33, 67, 134, 268, 1074):
        n = mb * 10**6 // 2
        for chunk_kb in ((16, 32, 64, 128, 256) if mb in (67, 134) else (64, 256)):
            chunk = chunk_kb * 1024 // 2
            programs = max(1, n // chunk)
            n_used = programs * chunk
            bufs = [torch.empty(n_used, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(rotate)]
            out = torch.empty(programs, dtype=torch.float32, device="cuda")
            calls = [lambda x=x: _read_kernel[(programs,)](x, out, chunk, BLOCK=block, num_warps=4) for x in bufs]
            us = bench_us(rotating(calls))
            tbs = n_used * 2 / (us * 1e-6) / 1e12
            rows.append({"mb": n_used * 2 / 1e6, "chunk_kb": chunk_kb, "programs": programs, "us": us, "tb_s": tbs})
            print(f"  read {n_used * 2 / 1e6:8.1f} MB  chunk {chunk_kb:4d} KB  {programs:6d} programs  {us:8.1f} us  {tbs:5.2f} TB/s")
            del bufs
            torch.cuda.empty_cache()
    return rows


def decode_point(batch: int, rotate: int, gen: torch.Generator) -> dict:
    q, k, v, bt, lens, sels, counts = sparse_decode_inputs(batch, HQ, HKV, HEAD_DIM, BLOCK_SIZE, K_SEL, BLOCK_SIZE, CTX,
                                                           rotate, gen, spare_blocks=64)
    scale = HEAD_DIM**-0.5
    kv_bytes = batch * HKV * K_SEL * BLOCK_SIZE * HEAD_DIM * 2 * 2
    out = torch.empty_like(q)
    res: dict = {"batch": batch, "kv_mb": kv_bytes / 1e6, "variants": {}}
    ref = sparse_paged_decode_attention_ref(q, k, v, bt, lens, sels[0], counts, scale)

    merge_kernel = paged_decode._merge_splits_kernel

    class _Skip:  # stands in for the merge kernel: launching it does nothing
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    for bn, warps, stages in CONFIGS:
        for splits in SPLITS:
            name = f"bn{bn}_w{warps}_s{stages}_splits{splits}"
            call = lambda sel: lambda: sparse_paged_decode_attention(  # noqa: E731
                q, k, v, bt, lens, sel, counts, scale, num_splits=splits, out=out, block_n=bn, num_warps=warps,
                num_stages=stages)
            try:
                call(sels[0])()
            except Exception as exc:  # noqa: BLE001 - a config that does not fit (shared memory) is reported
                print(f"  B={batch} {name:28s} failed: {type(exc).__name__}")
                continue
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            if not err < 1e-2:
                raise SystemExit(f"{name}: rel err {err:.2e}")
            row = {}
            for mode in ("both", "stage1"):
                if mode == "stage1":
                    paged_decode._merge_splits_kernel = _Skip()
                try:
                    row[mode] = bench_us(rotating([call(s) for s in sels]))
                finally:
                    paged_decode._merge_splits_kernel = merge_kernel
            row["tb_s"] = kv_bytes / (row["both"] * 1e-6) / 1e12
            res["variants"][name] = row
            print(f"  B={batch} {name:28s} {row['both']:7.1f} us (stage 1 alone {row['stage1']:6.1f})  "
                  f"{row['tb_s']:5.2f} TB/s on the KV bytes")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rotate", type=int, default=4, help="input copies cycled through (defeats L2 reuse)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    res["copy_tb_s"] = measure_copy_bandwidth(1.0) / 1e12
    print(f"{res['device']}: copy {res['copy_tb_s']:.2f} TB/s (1 GiB, read + write)")
    x = torch.empty(1, device="cuda")
    res["empty_kernel_us"] = bench_us(lambda: _empty_kernel[(1,)](x))
    res["empty_kernel_132_us"] = bench_us(lambda: _empty_kernel[(132 * 4,)](x))
    print(f"empty kernel in a graph: {res['empty_kernel_us']:.2f} us (1 program), {res['empty_kernel_132_us']:.2f} us (528)")
    print("read floor by size:")
    res["read"] = read_floor(args.rotate)
    print("sparse decode, block 16, 2048 tokens selected per (sequence, KV head):")
    res["decode"] = [decode_point(b, args.rotate, gen) for b in (8, 16)]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
