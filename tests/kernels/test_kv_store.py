"""The KV store kernel writes exactly the slots asked, and the gather kernel reads a sequence out of
its pages, each like an explicit loop (interpreted on CPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.kernels.kv_store import gather_kv, gather_kv_ref, store_kv, store_kv_ref  # noqa: E402


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


@pytest.mark.parametrize("heads,dim,block_size,length", [(3, 64, 16, 75), (8, 48, 4, 64), (1, 16, 1, 5), (1, 4, 16, 1000)])
@pytest.mark.parametrize("impl", [gather_kv, gather_kv_ref])
def test_gather_kv_reads_a_sequence_out_of_its_pages_in_order(impl, heads, dim, block_size, length):
    """Pages in a shuffled order (the last one partly filled, the rest of the pool NaN) come out as
    `[heads, length, dim]` K and V, token t from page ids[t // block_size] slot t % block_size."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(heads + dim)
    pages = -(-length // block_size)  # (1, 4, 16, 1000): 63 pages, many programs, the last one partial
    kc = torch.full((pages + 4, heads, block_size, dim), float("nan"))
    vc = kc.clone()
    ids = torch.randperm(pages + 4, generator=g)[: pages + 2]  # the table runs past the sequence, as the engine's may
    want_k, want_v = torch.randn(heads, length, dim, generator=g), torch.randn(heads, length, dim, generator=g)
    for t in range(length):  # the definition, one token at a time (the 2 extra pages stay NaN)
        kc[ids[t // block_size], :, t % block_size] = want_k[:, t]
        vc[ids[t // block_size], :, t % block_size] = want_v[:, t]
    k, v = impl(kc.to(dev), vc.to(dev), ids.to(dev), length)
    assert k.shape == v.shape == (heads, length, dim)
    assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)


def test_gather_kv_refuses_a_table_too_short_or_k_and_v_that_differ():
    kc = torch.zeros(4, 2, 16, 8)
    with pytest.raises(ValueError, match="pages of 16"):
        gather_kv(kc, kc.clone(), torch.tensor([0, 1]), 33)
    with pytest.raises(ValueError, match="one shape, dtype"):
        gather_kv(kc, kc.double(), torch.tensor([0, 1, 2]), 33)
