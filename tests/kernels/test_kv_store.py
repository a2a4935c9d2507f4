"""The KV store kernel (interpreted on CPU) writes exactly the slots asked, like an explicit loop."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402


@pytest.mark.parametrize("heads,dim,block_size,dtype", [(3, 64, 16, torch.float32), (8, 32, 4, torch.bfloat16), (1, 16, 1, torch.float16)])
@pytest.mark.parametrize("impl", [store_kv, store_kv_ref])
def test_store_kv_writes_exact_slots(impl, heads, dim, block_size, dtype):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(heads * dim)
    n = 20
    num_blocks = 2 * n // block_size + 3  # more slots than tokens, most left untouched
    # Qkv-like strided views: k and v are slices of one wider row, as the engine passes them.
    fused = torch.randn(n, 2 * heads + 2, dim, generator=g).to(dtype)
    k, v = fused[:, :heads], fused[:, heads + 1 : 2 * heads + 1]
    kc = torch.full((num_blocks, heads, block_size, dim), float("nan"), dtype=dtype)
    vc = kc.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    expect_k, expect_v = kc.clone(), vc.clone()
    for i, s in enumerate(slots.tolist()):  # the definition, one token at a time
        expect_k[s // block_size, :, s % block_size] = k[i]
        expect_v[s // block_size, :, s % block_size] = v[i]
    kc_d, vc_d = kc.to(dev), vc.to(dev)
    impl(k.to(dev), v.to(dev), kc_d, vc_d, slots.to(dev))
    assert torch.equal(kc_d.cpu().nan_to_num(-7.0), expect_k.nan_to_num(-7.0))
    assert torch.equal(vc_d.cpu().nan_to_num(-7.0), expect_v.nan_to_num(-7.0))
