"""Which torch SDPA backend prefills fastest at long context (Qwen3-8B heads, causal, bf16)?

    python benchmarks/bench_prefill_attention.py --seq 32768 [--interleave] [--layouts] [--chunk 8192]

--interleave also times the engine-layout cuDNN call the way a prefill runs it: each call right
after the MLP's up-projection GEMM at the same token count, against the same call back to back
(CUDA events around each attention call; the GEMM's rate alongside).
--layouts times the cuDNN call on q/k/v laid out as the engine has them (strided views of the fused
projection), head-major contiguous copies, and token-major contiguous copies, in interleaved rounds
(a power-capped GPU drifts between runs), with the copies' own time.
--chunk C times each C-token chunk of a chunked prefill (its queries over every earlier key) the way
the engine runs it (`engine.attention.causal_sdpa`: cuDNN over the cached keys and over the chunk,
merged) against torch's bottom-right causal mask (its flash kernel), and checks they agree.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--interleave", action="store_true")
    ap.add_argument("--layouts", action="store_true")
    ap.add_argument("--chunk", type=int, default=0)
    a = ap.parse_args()
    n, h, hk, d = a.seq, a.heads, a.kv_heads, a.head_dim
    q = torch.randn(1, h, n, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, hk, n, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, hk, n, d, dtype=torch.bfloat16, device="cuda")
    ke, ve = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    # The engine's layout: q/k/v are strided [n, H, D] views of one fused projection output.
    qkv = torch.randn(n, (h + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    qe, ke_, ve_ = (t.view(n, -1, d).transpose(0, 1).unsqueeze(0) for t in qkv.split([h * d, hk * d, hk * d], -1))
    flops = 4 * h * d * n * n / 2
    if a.interleave:
        interleaved(qe, ke_, ve_, flops)
    if a.layouts:
        layouts(qkv, h, hk, d, flops)
    if a.chunk:
        chunks(qe[0], ke_[0], ve_[0], a.chunk)
    ref = None
    for name, backend in [("cudnn-engine-layout", SDPBackend.CUDNN_ATTENTION), ("flash-engine-layout", SDPBackend.FLASH_ATTENTION)]:
        with sdpa_kernel([backend]):
            fn = lambda: F.scaled_dot_product_attention(qe, ke_, ve_, is_causal=True, enable_gqa=True)  # noqa: E731
            ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
            qc, kc, vc = qe.contiguous(), ke_.contiguous(), ve_.contiguous()
            fn2 = lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)  # noqa: E731
            ms2 = do_bench(fn2, warmup=50, rep=300, return_mode="median")
        print(f"{name}: strided {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s), contiguous {ms2:.2f} ms ({flops / ms2 / 1e9:.0f})")
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        for gqa in (True, False):
            try:
                with sdpa_kernel([backend]):
                    fn = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) if gqa \
                        else (lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
                    out = fn()
                    ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
                if ref is None:
                    ref = out.float()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                print(f"{name:9s} gqa={gqa!s:5s}: {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  rel.err vs first {err:.1e}")
            except RuntimeError as e:
                print(f"{name:9s} gqa={gqa!s:5s}: unavailable ({str(e).splitlines()[0][:80]})")


def chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> None:
    from torch.nn.attention.bias import causal_lower_right

    from sparsetune.engine.attention import causal_sdpa, prefill_backends

    h, n, d = q.shape
    total = {"engine": 0.0, "bottom-right mask": 0.0}
    for c in range(chunk, n, chunk):
        e = min(c + chunk, n)
        qc, kc, vc = q[:, c:e], k[:, :e], v[:, :e]
        mask = causal_lower_right(e - c, e)
        with prefill_backends():
            new = lambda: causal_sdpa(qc, kc, vc, c, d**-0.5)  # noqa: E731
            old = lambda: F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=mask,  # noqa: E731
                                                         scale=d**-0.5, enable_gqa=True)[0]
            err = (new().float() - old().float()).abs().max().item()
            t_new = do_bench(new, warmup=10, rep=100, return_mode="median")
            t_old = do_bench(old, warmup=10, rep=100, return_mode="median")
        fl = 4 * h * d * (e - c) * (c + (e - c) / 2)
        total["engine"] += t_new
        total["bottom-right mask"] += t_old
        print(f"chunk {c}:{e}: engine {t_new:.2f} ms ({fl / t_new / 1e9:.0f} TFLOP/s), bottom-right mask "
              f"{t_old:.2f} ms ({fl / t_old / 1e9:.0f} TFLOP/s), max |diff| {err:.1e}", flush=True)
    print(f"chunks after the first, summed: " + ", ".join(f"{k} {t:.2f} ms" for k, t in total.items()), flush=True)


def layouts(qkv: torch.Tensor, h: int, hk: int, d: int, flops: float, rounds: int = 5) -> None:
    n = qkv.shape[0]
    q, k, v = (t.view(n, -1, d) for t in qkv.split([h * d, hk * d, hk * d], -1))  # [n, H, D] strided views
    hm = [t.transpose(0, 1).contiguous().unsqueeze(0) for t in (q, k, v)]  # [1, H, n, D] head-major
    tm = [t.contiguous().transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # token-major [n, H, D] buffers
    cases = {
        "engine (strided views)": [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)],
        "head-major contiguous": hm,
        "token-major contiguous": tm,
    }
    copies = {
        "copy q/k/v to head-major": lambda: [t.transpose(0, 1).contiguous() for t in (q, k, v)],
        "copy q/k/v to token-major": lambda: [t.contiguous() for t in (q, k, v)],
    }
    times: dict[str, list[float]] = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for name, (qq, kk, vv) in cases.items():
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            print(f"{name}: q strides {tuple(qq.stride())}, output strides {tuple(o.stride())}")
        for _ in range(rounds):
            for name, (qq, kk, vv) in cases.items():
                fn = lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)  # noqa: E731
                times.setdefault(name, []).append(do_bench(fn, warmup=10, rep=100, return_mode="median"))
            for name, fn in copies.items():
                times.setdefault(name, []).append(do_bench(fn, warmup=10, rep=50, return_mode="median"))
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        extra = f" ({flops / ms / 1e9:.0f} TFLOP/s)" if name in cases else ""
        print(f"{name}: {ms:.3f} ms{extra}, rounds {' '.join(f'{t:.2f}' for t in ts)}", flush=True)


def interleaved(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: float, iters: int = 36) -> None:
    n = q.shape[2]
    x = torch.randn(n, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(24576, 4096, dtype=torch.bfloat16, device="cuda")
    gemm_flops = 2 * n * 4096 * 24576

    def attn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for label, before in [("back to back", None), ("after a GEMM", lambda: x @ w.t())]:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2 * iters)]
            gev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2 * iters)]
            for i in range(2 * iters):  # the first half warms up (clocks settle)
                if before is not None:
                    gev[i][0].record()
                    before()
                    gev[i][1].record()
                ev[i][0].record()
                attn()
                ev[i][1].record()
            torch.cuda.synchronize()
            ms = sorted(s.elapsed_time(e) for s, e in ev[iters:])[iters // 2]
            line = f"cudnn-engine-layout {label}: {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s)"
            if before is not None:
                gms = sorted(s.elapsed_time(e) for s, e in gev[iters:])[iters // 2]
                line += f"; the GEMM {gms:.2f} ms ({gemm_flops / gms / 1e9:.0f} TFLOP/s)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
