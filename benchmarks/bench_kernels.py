#!/usr/bin/env python
"""GPU microbenchmark for sparsetune.kernels (not a test; run it on an H100/H200).

    python benchmarks/bench_kernels.py [--quick] [--skip-large] [--json-out out.json]

What it does (about 1-2 minutes):
  1. measures device copy bandwidth (large D2D copy, read + written bytes / time),
     the practical roofline for a memory-bound kernel;
  2. checks every paged-decode config variant against the torch reference on a
     small shuffled-block-table case (and stops if one is wrong);
  3. times paged decode attention at Qwen3-8B decode shapes (Hq 32, Hkv 8, D 128,
     block 16, bf16, shuffled block tables) for several (batch, context) points
     and config variants (BLOCK_N / warps / stages, then num_splits around the
     heuristic's choice), reporting us, KV GB/s and the fraction of copy
     bandwidth, next to torch SDPA on a contiguous KV of the same size;
  4. times block-sparse paged decode (sparse_paged_decode_attention) at the same
     shapes: 32K-token contexts of which K=128 random blocks (2048 tokens) per
     (sequence, kv head) are selected, reporting GB/s on the KV bytes actually
     read, next to dense paged decode over 2048-token contexts (same bytes);
  5. times the fused ops at decode (N=16) and prefill (N=32768) sizes against
     their torch twins;
  6. prints a compact table and optionally writes everything as JSON.

Stream safety: triton's do_bench_cudagraph runs the benchmarked function on a
fresh side stream that does NOT wait for the default stream, so every input must
be fully written before timing starts (bench_us synchronises first), and nothing
may be freed while work that uses it can still be in flight (_release_memory).

    python benchmarks/bench_kernels.py --compile-only [--target cuda:90]

compiles every kernel variant ahead of time for the target GPU WITHOUT a GPU (the
Triton interpreter used by the CPU tests does not enforce GPU-only rules) and
prints registers / shared memory / spills per variant. The test-suite runs this.

    python benchmarks/bench_kernels.py --cpu-smoke

runs the whole benchmark flow on CPU through the Triton interpreter with tiny
shapes and wall-clock timing (numbers meaningless) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

CPU_SMOKE = "--cpu-smoke" in sys.argv
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the triton import
elif os.environ.pop("TRITON_INTERPRET", None) not in (None, "0"):
    # This script is about real GPU code; the interpreter would silently replace it.
    print("note: ignoring TRITON_INTERPRET for the benchmark", file=sys.stderr)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from common import bench_us as common_bench_us  # noqa: E402

from sparsetune.kernels import fused_ops, paged_decode  # noqa: E402
from sparsetune.kernels.fused_ops import (  # noqa: E402
    apply_rope,
    apply_rope_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    rms_norm,
    rms_norm_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from sparsetune.kernels.paged_decode import (  # noqa: E402
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    sparse_paged_decode_attention,
    sparse_paged_decode_attention_ref,
)
from sparsetune.perf.timing import sync, time_calls  # noqa: E402

DEVICE = "cuda"
# Qwen3-8B attention / MLP shapes.
HQ, HKV, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 12288
DTYPE = torch.bfloat16
ROPE_MAX_POS = 40960

DECODE_POINTS = [(8, 32768), (16, 16384), (16, 32768), (64, 4096)]
LARGE_POINTS = {(16, 32768)}
# Block-sparse decode: (batch, context) points, K selected blocks per (seq, kv head).
SPARSE_POINTS = [(16, 32768), (8, 32768)]
SPARSE_K = 128  # 2048 tokens at block size 16
FUSED_TOKENS = (16, 32768)  # decode, prefill
CHECK_BATCH_CTX = (6, 1000)  # correctness case
COPY_GIB = (2, 1)  # full, --quick

# (block_n, num_warps, num_stages, prefetch); the first one is the library default
# for bf16 D=128. prefetch=True is the hand-pipelined (register prefetch) loop.
Config = tuple[int, int, int, bool]
CONFIGS_FULL: list[Config] = [
    (64, 4, 3, False), (64, 4, 2, False), (128, 8, 3, False), (32, 4, 5, False),
    (64, 4, 1, True), (64, 8, 1, True), (128, 8, 1, True), (32, 4, 1, True),
]
CONFIGS_QUICK: list[Config] = [(64, 4, 3, False), (128, 8, 3, False), (64, 4, 1, True), (128, 8, 1, True)]


def cfg_kwargs(cfg: Config) -> dict[str, Any]:
    return dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], prefetch=cfg[3])


def cfg_name(cfg: Config) -> str:
    return f"bn{cfg[0]}_w{cfg[1]}_s{cfg[2]}" + ("_pf" if cfg[3] else "")


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _release_memory() -> None:
    """Free cached device memory safely: wait for ALL streams first (a kernel
    still running on a side stream may read the tensors just dropped), collect
    garbage so no CUDA graph object outlives the tensors it references (a graph
    keeps its private memory pool and raw pointers into its inputs), and only
    then hand the cache back to the driver."""
    sync(DEVICE)
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_us(fn: Callable[[], Any], use_graph: bool = True, rep_ms: int = 60) -> float:
    """common.bench_us, or one wall-clock call in --cpu-smoke mode."""
    if CPU_SMOKE:
        return 1e6 * time_calls(fn, DEVICE, 1, warmup=1)[0]
    return common_bench_us(fn, use_graph, rep_ms)


def copy_bandwidth_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), use_graph=False, rep_ms=100)
    del src, dst
    _release_memory()
    return 2 * nbytes / (us * 1e-6) / 1e9


def make_paged_kv(batch: int, ctx: int, gen: torch.Generator, slack_blocks: int = 64):
    """Random bf16 paged KV for `batch` sequences of `ctx` tokens, shuffled blocks."""
    max_blocks = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * max_blocks + slack_blocks
    shape = (num_blocks, HKV, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    v_cache = torch.empty(shape, dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen)[: batch * max_blocks]
    block_tables = perm.view(batch, max_blocks).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.empty((batch, HQ, HEAD_DIM), dtype=DTYPE, device=DEVICE).normal_(generator=gen)
    sync(DEVICE)  # initialised before any other stream uses them
    return q, k_cache, v_cache, block_tables, seq_lens


def random_selection(batch: int, ctx: int, k_sel: int, gen: torch.Generator):
    """K distinct random logical blocks per (sequence, kv head), in random order."""
    n_blk = math.ceil(ctx / BLOCK_SIZE)
    keys = torch.rand((batch, HKV, n_blk), device=DEVICE, generator=gen)
    sel = keys.argsort(dim=-1)[..., :k_sel].to(torch.int32).contiguous()
    counts = torch.full((batch, HKV), k_sel, dtype=torch.int32, device=DEVICE)
    sync(DEVICE)
    return sel, counts


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --------------------------------------------------------------------------- #
# paged decode
# --------------------------------------------------------------------------- #


def check_configs(configs: list[Config], gen: torch.Generator) -> dict[str, float]:
    """Small mixed-length case vs the torch reference, for every config and a few splits."""
    batch, ctx = CHECK_BATCH_CTX
    q, k, v, bt, _ = make_paged_kv(batch, ctx, gen)
    seq_lens = torch.tensor([ctx, 1, 0, ctx // 2 + 17, 16, ctx - 1], dtype=torch.int32, device=DEVICE)
    bt[2, :] = -1  # padding row: table never read
    bt[1, 1:] = 2**30  # garbage past the used blocks
    scale = HEAD_DIM**-0.5
    ref = paged_decode_attention_ref(q, k, v, bt, seq_lens, scale)
    errs = {}
    for cfg in configs:
        for splits in (None, 1, 5):
            out = paged_decode_attention(q, k, v, bt, seq_lens, scale, num_splits=splits, **cfg_kwargs(cfg))
            err = rel_err(out, ref)
            key = f"{cfg_name(cfg)}_splits{splits}"
            errs[key] = err
            if not (err < 1e-2) or not torch.equal(out[2], torch.zeros_like(out[2])):
                raise SystemExit(f"correctness check FAILED for {key}: rel err {err:.3e}")
    # Block-sparse: random selections with mixed counts (0 .. K, K for row 0 of
    # sequence 0), random order, garbage past each count.
    k_sel = max(2, math.ceil(ctx / BLOCK_SIZE) // 3)
    g = torch.Generator().manual_seed(1)
    sel = torch.full((batch, HKV, k_sel), 2**30, dtype=torch.int32)
    counts = torch.zeros((batch, HKV), dtype=torch.int32)
    for b, seq_len in enumerate(seq_lens.tolist()):
        n_blk = math.ceil(seq_len / BLOCK_SIZE)
        for h in range(HKV):
            c = k_sel if (b, h) == (0, 0) else int(torch.randint(0, min(k_sel, n_blk) + 1, (1,), generator=g))
            sel[b, h, :c] = torch.randperm(n_blk, generator=g)[:c].to(torch.int32)
            counts[b, h] = c
    sel, counts = sel.to(DEVICE), counts.to(DEVICE)
    sparse_ref = sparse_paged_decode_attention_ref(q, k, v, bt, seq_lens, sel, counts, scale)
    for cfg in configs:
        if cfg[3]:
            continue  # the hand-pipelined loop is dense-only
        for splits in (1, 5):  # direct store and merged splits (auto gives 1 here)
            kw = cfg_kwargs(cfg)
            kw.pop("prefetch")
            out = sparse_paged_decode_attention(q, k, v, bt, seq_lens, sel, counts, scale, num_splits=splits, **kw)
            err = rel_err(out, sparse_ref)
            key = f"sparse_{cfg_name(cfg)}_splits{splits}"
            errs[key] = err
            if not (err < 1e-2) or not torch.equal(out[2], torch.zeros_like(out[2])):
                raise SystemExit(f"correctness check FAILED for {key}: rel err {err:.3e}")
    print(f"correctness: {len(errs)} variants ok, max rel err vs ref {max(errs.values()):.2e}")
    return errs


def bench_decode_point(
    batch: int, ctx: int, configs: list[Config], copy_gbs: float, gen: torch.Generator, quick: bool
) -> dict[str, Any]:
    q, k, v, bt, seq_lens = make_paged_kv(batch, ctx, gen)
    scale = HEAD_DIM**-0.5
    kv_bytes = batch * ctx * HKV * HEAD_DIM * 2 * 2
    out = torch.empty_like(q)
    auto_splits = choose_num_splits(batch, HKV, bt.shape[1], BLOCK_SIZE, paged_decode.num_sms(q.device))
    res: dict[str, Any] = {"batch": batch, "ctx": ctx, "kv_bytes": kv_bytes, "auto_splits": auto_splits, "variants": {}}

    def run(cfg: Config, splits: int | None) -> float:
        fn = lambda: paged_decode_attention(  # noqa: E731
            q, k, v, bt, seq_lens, scale, num_splits=splits, out=out, **cfg_kwargs(cfg)
        )
        us = bench_us(fn)
        gbs = kv_bytes / (us * 1e-6) / 1e9
        key = f"{cfg_name(cfg)}_splits{splits if splits else auto_splits}"
        res["variants"][key] = {"us": us, "gbs": gbs, "frac_copy_bw": gbs / copy_gbs}
        print(f"  {key:28s} {us:9.1f} us  {gbs:7.0f} GB/s  {gbs / copy_gbs:6.1%} of copy bw")
        return us

    times = {cfg: run(cfg, None) for cfg in configs}
    best_cfg = min(times, key=times.get)
    split_opts = [max(1, auto_splits // 2), auto_splits * 2] if quick else [max(1, auto_splits // 4), max(1, auto_splits // 2), auto_splits * 2]
    for splits in sorted(set(split_opts) - {auto_splits}):
        run(best_cfg, splits)
    best_key = min(res["variants"], key=lambda kk: res["variants"][kk]["us"])
    res["best"] = {"key": best_key, **res["variants"][best_key]}

    # Reference point: torch SDPA (GQA) on a contiguous KV of the same size.
    del k, v, bt
    _release_memory()
    try:
        kc = torch.empty((batch, HKV, ctx, HEAD_DIM), dtype=DTYPE, device=DEVICE).normal_(generator=gen)
        vc = torch.empty_like(kc).normal_(generator=gen)
        q4 = q.view(batch, HQ, 1, HEAD_DIM)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, scale=scale, enable_gqa=True)  # noqa: E731
        us = bench_us(sdpa)
        gbs = kv_bytes / (us * 1e-6) / 1e9
        res["sdpa_contiguous"] = {"us": us, "gbs": gbs, "frac_copy_bw": gbs / copy_gbs}
        print(f"  {'torch SDPA (contiguous KV)':28s} {us:9.1f} us  {gbs:7.0f} GB/s  {gbs / copy_gbs:6.1%} of copy bw")
        del kc, vc
    except Exception as exc:  # noqa: BLE001 - reference point only
        res["sdpa_contiguous"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        print(f"  torch SDPA failed: {res['sdpa_contiguous']['error']}")
    _release_memory()
    return res


def bench_sparse_point(
    batch: int, ctx: int, k_sel: int, configs: list[Config], copy_gbs: float, gen: torch.Generator
) -> dict[str, Any]:
    """Block-sparse decode: `ctx`-token sequences, `k_sel` random blocks per (seq, kv head)."""
    q, k, v, bt, seq_lens = make_paged_kv(batch, ctx, gen)
    sel, counts = random_selection(batch, ctx, k_sel, gen)
    scale = HEAD_DIM**-0.5
    # Bytes actually read: K and V of the selected tokens (all blocks are full).
    kv_bytes = batch * HKV * k_sel * BLOCK_SIZE * HEAD_DIM * 2 * 2
    out = torch.empty_like(q)
    auto_splits = choose_num_splits(batch, HKV, k_sel, BLOCK_SIZE, paged_decode.num_sms(q.device), sparse=True)
    res: dict[str, Any] = {"batch": batch, "ctx": ctx, "k_sel": k_sel, "block_size": BLOCK_SIZE, "kv_bytes": kv_bytes,
                           "auto_splits": auto_splits, "variants": {}}

    ref = sparse_paged_decode_attention_ref(q, k, v, bt, seq_lens, sel, counts, scale)
    got = sparse_paged_decode_attention(q, k, v, bt, seq_lens, sel, counts, scale)
    res["rel_err_vs_ref"] = rel_err(got, ref)
    del ref, got
    if not res["rel_err_vs_ref"] < 1e-2:
        raise SystemExit(f"sparse correctness FAILED at B={batch} ctx={ctx}: rel err {res['rel_err_vs_ref']:.3e}")

    def report(key: str, us: float) -> None:
        gbs = kv_bytes / (us * 1e-6) / 1e9
        res["variants"][key] = {"us": us, "gbs": gbs, "frac_copy_bw": gbs / copy_gbs}
        print(f"  {key:28s} {us:9.1f} us  {gbs:7.0f} GB/s  {gbs / copy_gbs:6.1%} of copy bw")

    def run(cfg: Config, splits: int | None) -> float:
        kw = cfg_kwargs(cfg)
        kw.pop("prefetch")
        fn = lambda: sparse_paged_decode_attention(  # noqa: E731
            q, k, v, bt, seq_lens, sel, counts, scale, num_splits=splits, out=out, **kw
        )
        us = bench_us(fn)
        report(f"sparse_{cfg_name(cfg)}_splits{splits if splits else auto_splits}", us)
        return us

    sparse_cfgs = [cfg for cfg in configs if not cfg[3]]  # no hand-pipelined sparse loop
    times = {cfg: run(cfg, None) for cfg in sparse_cfgs}
    best_cfg = min(times, key=times.get)
    for splits in sorted({max(1, auto_splits // 2), auto_splits * 2, auto_splits * 4} - {auto_splits}):
        run(best_cfg, splits)
    best_key = min(res["variants"], key=lambda kk: res["variants"][kk]["us"])
    res["best"] = {"key": best_key, **res["variants"][best_key]}

    # Same bytes, dense: the first k_sel blocks of every sequence (default config).
    n_tok = k_sel * BLOCK_SIZE
    bt_dense = bt[:, :k_sel]
    lens_dense = torch.full_like(seq_lens, n_tok)
    sync(DEVICE)
    us = bench_us(lambda: paged_decode_attention(q, k, v, bt_dense, lens_dense, scale, out=out))
    gbs = kv_bytes / (us * 1e-6) / 1e9
    res["dense_same_bytes"] = {"ctx": n_tok, "us": us, "gbs": gbs, "frac_copy_bw": gbs / copy_gbs}
    print(f"  {'dense paged, ctx ' + str(n_tok):28s} {us:9.1f} us  {gbs:7.0f} GB/s  {gbs / copy_gbs:6.1%} of copy bw")

    del q, k, v, bt, seq_lens, sel, counts, out, bt_dense, lens_dense
    _release_memory()
    return res


# --------------------------------------------------------------------------- #
# fused ops
# --------------------------------------------------------------------------- #


def bench_fused(n_tokens: int, gen: torch.Generator) -> dict[str, Any]:
    dev = DEVICE
    x = torch.empty((n_tokens, HIDDEN), dtype=DTYPE, device=dev).normal_(generator=gen)
    r = torch.empty_like(x).normal_(generator=gen)
    w = torch.empty((HIDDEN,), dtype=DTYPE, device=dev).normal_(generator=gen)
    gu = torch.empty((n_tokens, 2 * INTERMEDIATE), dtype=DTYPE, device=dev).normal_(generator=gen)
    qkv = torch.empty((n_tokens, (HQ + 2 * HKV) * HEAD_DIM), dtype=DTYPE, device=dev).normal_(generator=gen)
    q = qkv[:, : HQ * HEAD_DIM].view(n_tokens, HQ, HEAD_DIM)
    kk = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(n_tokens, HKV, HEAD_DIM)
    cache = torch.randn((ROPE_MAX_POS, HEAD_DIM), dtype=torch.float32, device=dev, generator=gen)
    pos = torch.randint(0, ROPE_MAX_POS, (n_tokens,), device=dev, generator=gen)
    hw = torch.ones(HEAD_DIM, dtype=DTYPE, device=dev)
    e = x.element_size()
    xb = x.numel() * e
    qk_bytes = 2 * (q.numel() + kk.numel()) * e  # read + write
    ops = {
        "rms_norm": (lambda: rms_norm(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6), 2 * xb),
        "rms_norm+residual": (lambda: rms_norm(x, w, 1e-6, r), lambda: rms_norm_ref(x, w, 1e-6, r), 4 * xb),
        "silu_and_mul": (lambda: silu_and_mul(gu), lambda: silu_and_mul_ref(gu), gu.numel() * e * 3 // 2),
        "apply_rope": (lambda: apply_rope(q, kk, pos, cache), lambda: apply_rope_ref(q, kk, pos, cache), qk_bytes),
        "qk_norm_rope": (
            lambda: qk_norm_rope(q, kk, pos, cache, hw, hw, 1e-6),
            lambda: qk_norm_rope_ref(q, kk, pos, cache, hw, hw, 1e-6),
            qk_bytes,
        ),
    }
    out: dict[str, Any] = {}
    for name, (fn, ref_fn, nbytes) in ops.items():
        try:
            t = bench_us(fn, rep_ms=40)
            t_ref = bench_us(ref_fn, rep_ms=40)
            out[name] = {"us": t, "torch_us": t_ref, "gbs": nbytes / (t * 1e-6) / 1e9, "speedup": t_ref / t}
            print(f"  N={n_tokens:<6d} {name:18s} {t:9.1f} us  (torch {t_ref:9.1f} us, x{t_ref / t:4.1f})  {out[name]['gbs']:6.0f} GB/s")
        except Exception as exc:  # noqa: BLE001
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            print(f"  N={n_tokens:<6d} {name:18s} FAILED: {out[name]['error']}")
    del x, r, gu, qkv, q, kk, cache, pos, hw, ops
    _release_memory()
    return out


# --------------------------------------------------------------------------- #
# ahead-of-time compilation (no GPU needed)
# --------------------------------------------------------------------------- #


class _Capture:
    """Stands in for a jitted kernel: records launches instead of running them."""

    def __init__(self, kernel: Any, sink: list) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.sink.append((self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def _capture_launches(sink: list):
    patched = []
    for mod in (paged_decode, fused_ops):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                patched.append((mod, name, obj))
                setattr(mod, name, _Capture(obj, sink))
        patched.append((mod, "_INTERPRET", mod._INTERPRET))
        mod._INTERPRET = True  # lets the wrappers accept meta tensors; flags fixed below
    try:
        yield
    finally:
        for mod, name, obj in patched:
            setattr(mod, name, obj)


def _aot_compile(kernel: Any, args: tuple, kwargs: dict, target: Any) -> dict[str, Any]:
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps", 4)
    num_stages = kwargs.pop("num_stages", 3)
    # The capture ran with the interpreter flag on: restore the GPU values.
    for flag in ("UPCAST_DOT", "EMULATE_BF16"):
        if flag in kwargs:
            kwargs[flag] = False
    names = kernel.arg_names
    positional = [n for n in names if n not in kwargs]
    assert len(positional) == len(args), (kernel.__name__, positional, len(args))
    signature, attrs, constexprs = {}, {}, dict(kwargs)
    for name, arg in zip(positional, args):
        # Same specialisation as a runtime launch: ints == 1 become constexprs,
        # 16-divisible ints / 16-byte aligned pointers get divisibility hints.
        ty, key = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = key
        elif isinstance(key, str):
            attr = BaseBackend.parse_attr(key)
            if attr:
                attrs[(names.index(name),)] = attr
    for name in kwargs:
        signature[name] = "constexpr"
    signature = {n: signature[n] for n in names}
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    t0 = time.time()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    info = {"kernel": kernel.__name__, "shared": compiled.metadata.shared, "compile_s": time.time() - t0}
    info.update(_cubin_resources(compiled.asm.get("cubin")))
    return info


def _cubin_resources(cubin: bytes | None) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubin is None or not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    out = {}
    for key, name in (("REG", "regs"), ("STACK", "stack")):
        m = re.search(rf"{key}:(\d+)", text)
        if m:
            out[name] = int(m.group(1))
    return out


_ABBREV = {"HEAD_DIM": "D", "GROUP": "G", "BLOCK_SIZE": "bs", "BLOCK_N": "bn", "DIRECT_OUT": "direct=", "BLOCK": "block",
           "NUM_Q_HEADS": "hq", "NUM_K_HEADS": "hk", "Q_HEADS_PAD": "hq_pad", "K_HEADS_PAD": "hk_pad", "HALF": "half",
           "NORM": "norm=", "HAS_RESIDUAL": "residual=", "SPLITS_PAD": "splits_pad", "PREFETCH": "prefetch=",
           "SPARSE": "sparse="}


def compile_only(target_str: str, quick: bool) -> int:
    from triton.backends.compiler import GPUTarget

    backend_name, arch = target_str.split(":")
    target = GPUTarget(backend_name, int(arch), 32)
    meta = "meta"
    launches: list = []
    with _capture_launches(launches):
        # paged decode: dtypes, head dims, GQA groups, block sizes, direct/merged
        # outputs and the benchmark's config variants.
        cases = [
            # (dtype, D, Hq, Hkv, block_size, splits, cfg)
            (torch.bfloat16, 128, 32, 8, 16, 17, None),
            (torch.bfloat16, 128, 32, 8, 16, 1, None),
            (torch.float16, 64, 9, 3, 1, 4, None),
            (torch.float32, 128, 32, 8, 16, 4, None),
            (torch.bfloat16, 256, 16, 2, 256, 4, None),
            (torch.float32, 256, 8, 8, 64, 2, None),
        ]
        configs = CONFIGS_QUICK if quick else CONFIGS_FULL
        cases += [(torch.bfloat16, 128, 32, 8, 16, 17, cfg) for cfg in configs]
        for dtype, d, hq, hkv, bs, splits, cfg in cases:
            q = torch.empty((4, hq, d), dtype=dtype, device=meta)
            kc = torch.empty((64, hkv, bs, d), dtype=dtype, device=meta)
            bt = torch.empty((4, 16), dtype=torch.int32, device=meta)
            sl = torch.empty((4,), dtype=torch.int32, device=meta)
            kw = {} if cfg is None else cfg_kwargs(cfg)
            paged_decode_attention(q, kc, kc, bt, sl, d**-0.5, num_splits=splits, **kw)
            if kw.get("prefetch"):
                continue  # dense-only loop
            kw.pop("prefetch", None)
            # Block-sparse variant of the same case (two-level gather, empty-tile-safe softmax).
            sel = torch.empty((4, hkv, 8), dtype=torch.int32, device=meta)
            cnt = torch.empty((4, hkv), dtype=torch.int32, device=meta)
            sparse_paged_decode_attention(q, kc, kc, bt, sl, sel, cnt, d**-0.5, num_splits=splits, **kw)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.empty((16, HIDDEN), dtype=dtype, device=meta)
            w = torch.empty((HIDDEN,), dtype=dtype, device=meta)
            rms_norm(x, w, 1e-6)
            rms_norm(x, w, 1e-6, x)
            silu_and_mul(torch.empty((16, 2 * INTERMEDIATE), dtype=dtype, device=meta))
            qkv = torch.empty((16, (HQ + 2 * HKV) * HEAD_DIM), dtype=dtype, device=meta)
            q = qkv[:, : HQ * HEAD_DIM].view(16, HQ, HEAD_DIM)
            k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(16, HKV, HEAD_DIM)
            pos = torch.empty((16,), dtype=torch.int64, device=meta)
            cache = torch.empty((4096, HEAD_DIM), dtype=torch.float32, device=meta)
            hw = torch.empty((HEAD_DIM,), dtype=dtype, device=meta)
            apply_rope(q, k, pos, cache)
            qk_norm_rope(q, k, pos, cache, hw, hw, 1e-6)
        # SmolLM2-like rope: 9 q heads / 3 kv heads, D 64.
        q = torch.empty((16, 9, 64), dtype=torch.bfloat16, device=meta)
        k = torch.empty((16, 3, 64), dtype=torch.bfloat16, device=meta)
        apply_rope(q, k, torch.empty((16,), dtype=torch.int32, device=meta), torch.empty((2048, 64), dtype=torch.float32, device=meta))

    failures = 0
    print(f"{'kernel':30s} {'variant':76s} {'regs':>5s} {'smem':>7s} {'stack':>5s}")
    seen = set()
    for kernel, args, kwargs in launches:
        shown = {k: v for k, v in kwargs.items() if k not in ("UPCAST_DOT", "EMULATE_BF16")}
        dtypes = tuple(str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor))[:2]
        key = (kernel.__name__, tuple(sorted(shown.items())), dtypes)
        if key in seen:
            continue
        seen.add(key)
        desc = " ".join(
            f"{_ABBREV.get(k, k)}{'=' if k not in _ABBREV else ''}{v}"
            for k, v in shown.items()
            if k not in ("num_warps", "num_stages", "NUM_KV_HEADS", "GROUP_PAD", "DOT_PRECISION")
        )
        desc = f"{dtypes[0] if dtypes else ''} {desc} w{kwargs.get('num_warps')}s{kwargs.get('num_stages', '-')}"
        try:
            info = _aot_compile(kernel, args, kwargs, target)
            print(f"{kernel.__name__:30s} {desc[:76]:76s} {info.get('regs', '?'):>5} {info['shared']:>7d} {info.get('stack', '?'):>5}")
            if info.get("stack", 0) > 0:
                print("    ^ uses local memory (register spills)")
        except Exception as exc:  # noqa: BLE001
            failures += 1
            print(f"{kernel.__name__:30s} {desc[:76]:76s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
    if failures:
        print(f"compile-only: {failures} of {len(seen)} variants FAILED for {target_str}")
        return 1
    print(f"compile-only: all {len(seen)} variants compiled for {target_str}")
    return 0


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #


def _configure_cpu_smoke() -> None:
    """Tiny shapes on CPU so the whole flow runs under the interpreter in seconds."""
    global DEVICE, HQ, HKV, HEAD_DIM, HIDDEN, INTERMEDIATE, ROPE_MAX_POS
    global DECODE_POINTS, LARGE_POINTS, FUSED_TOKENS, CHECK_BATCH_CTX, COPY_GIB, CONFIGS_FULL, CONFIGS_QUICK
    global SPARSE_POINTS, SPARSE_K
    DEVICE = "cpu"
    HQ, HKV, HEAD_DIM = 4, 2, 32
    HIDDEN, INTERMEDIATE, ROPE_MAX_POS = 64, 96, 128
    DECODE_POINTS = [(2, 96), (3, 32)]
    LARGE_POINTS = {(3, 32)}  # exercises --skip-large
    FUSED_TOKENS = (3,)
    CHECK_BATCH_CTX = (6, 40)
    COPY_GIB = (1 / 1024, 1 / 1024)
    CONFIGS_FULL = CONFIGS_QUICK = [(16, 4, 3, False), (16, 4, 1, True)]
    SPARSE_POINTS, SPARSE_K = [(1, 64)], 2



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer config variants, smaller copy test")
    ap.add_argument("--skip-large", action="store_true", help="skip the 16 x 32K decode point")
    ap.add_argument("--json-out", type=str, default=None, help="write all results as JSON here")
    ap.add_argument("--compile-only", action="store_true", help="AOT-compile all kernel variants (no GPU needed)")
    ap.add_argument("--target", type=str, default="cuda:90", help="target for --compile-only, e.g. cuda:90")
    ap.add_argument("--cpu-smoke", action="store_true", help="run the flow on CPU (interpreter, tiny shapes)")
    ap.add_argument("--sparse-block-sizes", default="16", help="KV block sizes of the sparse points, e.g. 2,4,8,16 "
                    "(the selection's tokens stay SPARSE_K x 16: 2048)")
    args = ap.parse_args()
    sparse_block_sizes = [int(b) for b in args.sparse_block_sizes.split(",")]

    if args.compile_only:
        return compile_only(args.target, args.quick)
    if args.cpu_smoke:
        _configure_cpu_smoke()
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --compile-only (or --cpu-smoke) on CPU", file=sys.stderr)
        return 2

    t_start = time.time()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__}
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        results.update(device=props.name, num_sms=props.multi_processor_count)
        print(f"device: {props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)")
    else:
        results.update(device="cpu (smoke run: timings meaningless)", num_sms=paged_decode.DEFAULT_NUM_SMS)

    copy_gb = COPY_GIB[1] if args.quick else COPY_GIB[0]
    copy_gbs = copy_bandwidth_gbs(int(copy_gb * 2**30))
    results["copy_bandwidth_gbs"] = copy_gbs
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read+write of a {copy_gb} GiB buffer)")

    configs = CONFIGS_QUICK if args.quick else CONFIGS_FULL
    results["correctness"] = check_configs(configs, gen)

    results["decode"] = []
    for batch, ctx in DECODE_POINTS:
        if args.skip_large and (batch, ctx) in LARGE_POINTS:
            print(f"decode B={batch} ctx={ctx}: skipped (--skip-large)")
            continue
        print(f"decode B={batch} ctx={ctx} (KV {batch * ctx * HKV * HEAD_DIM * 4 / 1e9:.2f} GB):")
        try:
            results["decode"].append(bench_decode_point(batch, ctx, configs, copy_gbs, gen, args.quick))
        except torch.cuda.OutOfMemoryError as exc:
            print(f"  OOM: {str(exc)[:120]}")
            results["decode"].append({"batch": batch, "ctx": ctx, "error": "OOM"})
        _release_memory()

    results["sparse"] = []
    global BLOCK_SIZE
    page, budget = BLOCK_SIZE, SPARSE_K * BLOCK_SIZE  # the selection's tokens, at every block size
    for BLOCK_SIZE in sparse_block_sizes:  # make_paged_kv and random_selection read it
        k_sel = max(1, budget // BLOCK_SIZE)
        for batch, ctx in SPARSE_POINTS:
            print(f"sparse decode B={batch} ctx={ctx} K={k_sel} blocks of {BLOCK_SIZE} "
                  f"(KV read {batch * HKV * k_sel * BLOCK_SIZE * HEAD_DIM * 4 / 1e9:.3f} GB):")
            try:
                results["sparse"].append(bench_sparse_point(batch, ctx, k_sel, configs, copy_gbs, gen))
            except torch.cuda.OutOfMemoryError as exc:
                print(f"  OOM: {str(exc)[:120]}")
                results["sparse"].append({"batch": batch, "ctx": ctx, "k_sel": k_sel, "block_size": BLOCK_SIZE, "error": "OOM"})
            _release_memory()
    BLOCK_SIZE = page

    results["fused"] = {}
    for n_tokens in FUSED_TOKENS:
        print(f"fused ops N={n_tokens}:")
        try:
            results["fused"][str(n_tokens)] = bench_fused(n_tokens, gen)
        except torch.cuda.OutOfMemoryError:
            print("  OOM")
            results["fused"][str(n_tokens)] = {"error": "OOM"}
        _release_memory()

    # Compact summary.
    print("\n=== paged decode (Qwen3-8B: Hq 32, Hkv 8, D 128, bs 16, bf16) ===")
    print(f"{'B':>4s} {'ctx':>6s} {'splits':>6s} {'best variant':30s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'sdpa us':>9s} {'sdpa %':>6s}")
    for r in results["decode"]:
        if "error" in r:
            print(f"{r['batch']:>4d} {r['ctx']:>6d} {r['error']}")
            continue
        best, sd = r["best"], r.get("sdpa_contiguous", {})
        sd_us = f"{sd['us']:9.1f}" if "us" in sd else f"{'n/a':>9s}"
        sd_fr = f"{sd['frac_copy_bw']:6.1%}" if "us" in sd else f"{'n/a':>6s}"
        print(f"{r['batch']:>4d} {r['ctx']:>6d} {r['auto_splits']:>6d} {best['key']:30s} {best['us']:9.1f} {best['gbs']:7.0f} {best['frac_copy_bw']:6.1%} {sd_us} {sd_fr}")
    # Which config wins overall (geometric mean over points, auto splits only).
    scores: dict[str, list[float]] = {}
    for r in results["decode"]:
        for key, val in r.get("variants", {}).items():
            if key.endswith(f"_splits{r['auto_splits']}"):
                scores.setdefault(key.rsplit("_splits", 1)[0], []).append(val["frac_copy_bw"])
    n_points = max((len(v) for v in scores.values()), default=0)
    ranked = sorted(
        ((math.exp(sum(map(math.log, v)) / len(v)), k) for k, v in scores.items() if len(v) == n_points), reverse=True
    )
    if ranked:
        print("config ranking (geomean fraction of copy bw, auto splits): " + ", ".join(f"{k} {s:.1%}" for s, k in ranked))
        results["config_ranking"] = [{"config": k, "geomean_frac_copy_bw": s} for s, k in ranked]
    print(f"\n=== block-sparse paged decode (same shapes, {SPARSE_K * BLOCK_SIZE} tokens per seq and kv head in blocks of bs) ===")
    print(f"{'bs':>3s} {'B':>4s} {'ctx':>6s} {'splits':>6s} {'best variant':30s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} {'dense us':>9s} {'dense %':>7s}")
    for r in results["sparse"]:
        if "error" in r:
            print(f"{r['batch']:>4d} {r['ctx']:>6d} {r['error']}")
            continue
        best, dn = r["best"], r["dense_same_bytes"]
        print(f"{r['block_size']:>3d} {r['batch']:>4d} {r['ctx']:>6d} {r['auto_splits']:>6d} {best['key']:30s} {best['us']:9.1f} {best['gbs']:7.0f} "
              f"{best['frac_copy_bw']:6.1%} {dn['us']:9.1f} {dn['frac_copy_bw']:7.1%}")
    print("\n=== fused ops (bf16) ===")
    for n_tokens, ops in results["fused"].items():
        for name, val in ops.items():
            if "us" in val:
                print(f"N={n_tokens:>6s} {name:18s} {val['us']:9.1f} us  torch {val['torch_us']:9.1f} us  x{val['speedup']:4.1f}  {val['gbs']:6.0f} GB/s")
    results["wall_s"] = time.time() - t_start
    print(f"\ntotal {results['wall_s']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
