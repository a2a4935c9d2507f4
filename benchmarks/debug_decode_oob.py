"""Reproduce one paged-decode launch at a given shape (for compute-sanitizer / CUDA_LAUNCH_BLOCKING).

    compute-sanitizer --tool memcheck python benchmarks/debug_decode_oob.py --batch 16 --ctx 16384
"""

from __future__ import annotations

import argparse
import math

import torch

from sparsetune.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--ctx", type=int, default=16384)
ap.add_argument("--splits", type=int, default=None)
ap.add_argument("--check", action="store_true")
a = ap.parse_args()
bs, hkv, hq, d = 16, 8, 32, 128
mb = math.ceil(a.ctx / bs)
nb = a.batch * mb + 64
g = torch.Generator(device="cuda").manual_seed(0)
k = torch.empty(nb, hkv, bs, d, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
v = torch.empty_like(k).normal_(generator=g)
bt = torch.randperm(nb, device="cuda", generator=g)[: a.batch * mb].view(a.batch, mb).to(torch.int32).contiguous()
sl = torch.full((a.batch,), a.ctx, dtype=torch.int32, device="cuda")
q = torch.empty(a.batch, hq, d, dtype=torch.bfloat16, device="cuda").normal_(generator=g)
out = paged_decode_attention(q, k, v, bt, sl, d**-0.5, num_splits=a.splits)
torch.cuda.synchronize()
print("ok", a.batch, a.ctx, out.float().abs().mean().item())
if a.check:
    ref = paged_decode_attention_ref(q, k, v, bt, sl, d**-0.5)
    print("rel err", ((out.float() - ref.float()).norm() / ref.float().norm()).item())
