"""Which torch SDPA backend prefills fastest at long context (Qwen3-8B heads, causal, bf16)?

    python benchmarks/bench_prefill_attention.py --seq 32768
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


if __name__ == "__main__":
    main()
