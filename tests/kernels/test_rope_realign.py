"""RoPE realignment of cached keys (interpreted Triton kernel and torch twin).

The truth is built without the paged pool or the delta trick: pre-RoPE keys rotated
directly at the new positions, in float64. Realigning keys cached at the old positions
by delta = new - old must land there (to float64 noise for the twin on float64 pools,
to fp32 noise for the fp32 kernel), with V copied bit for bit and every slot outside
the destinations untouched.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from sparsetune.engine.rope import cos_sin_table, inv_frequencies  # noqa: E402
from sparsetune.kernels import rope_realign  # noqa: E402
from sparsetune.kernels.fused_ops import apply_rope_ref  # noqa: E402
from sparsetune.kernels.rope_realign import realign_kv, realign_kv_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
THETA = 10000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Direct neox RoPE in float64: x [T, ..., D] at positions pos [T]."""
    half = x.shape[-1] // 2
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    shape = (len(pos),) + (1,) * (x.dim() - 2) + (half,)
    c, s = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def tok(pool: torch.Tensor) -> torch.Tensor:
    """[B+1, bs, L, H, D] view: pool of slots, indexable by (block, offset)."""
    return pool.permute(1, 3, 0, 2, 4)


def make_case(seed: int, head_dim: int, scaling: dict | None, *, layers: int = 3, heads: int = 2, block_size: int = 4,
              blocks: int = 16, n: int = 24, max_pos: int = 40000):
    """Pools (float64) with keys RoPE'd at `old` in n scattered src slots, and the truth at `new`.

    delta = new - old covers negative, zero and positive values; src and dst are disjoint
    random slots scattered over all blocks, moved in every layer.
    """
    g = torch.Generator().manual_seed(seed)
    inv_freq = inv_frequencies(head_dim, THETA, scaling)
    x = torch.randn(n, layers, heads, head_dim, generator=g, dtype=torch.float64)  # pre-RoPE keys
    old = torch.randint(max_pos // 2, max_pos, (n,), generator=g)
    delta = torch.randint(-(max_pos // 2), max_pos // 2, (n,), generator=g)
    delta[::5] = 0
    new = old + delta
    perm = torch.randperm((blocks + 1) * block_size, generator=g)
    src, dst = perm[:n], perm[n : 2 * n]
    shape = (layers, blocks + 1, heads, block_size, head_dim)
    k = torch.randn(shape, generator=g, dtype=torch.float64)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    tok(k)[src // block_size, src % block_size] = rope64(x, old, inv_freq)
    return dict(k=k, v=v, src=src, dst=dst, delta=delta, inv_freq=inv_freq, want=rope64(x, new, inv_freq))


def check(c: dict, k: torch.Tensor, v: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, atol: float, rtol: float
          ) -> None:
    """K at dst ~ truth; V at dst == V at src exactly; every other slot bit-identical to before."""
    bs = k.shape[3]
    src, dst = c["src"], c["dst"]
    got = tok(k)[dst // bs, dst % bs].double()
    torch.testing.assert_close(got, c["want"], atol=atol, rtol=rtol)
    assert torch.equal(tok(v)[dst // bs, dst % bs], tok(v0)[src // bs, src % bs])
    # Zero delta: the rotation is the identity, so K is copied exactly too.
    zero = c["delta"] == 0
    assert torch.equal(tok(k)[dst[zero] // bs, dst[zero] % bs], tok(k0)[src[zero] // bs, src[zero] % bs])
    keep = torch.ones(k.shape[1] * bs, dtype=torch.bool)
    keep[dst] = False
    keep_b, keep_o = keep.nonzero()[:, 0] // bs, keep.nonzero()[:, 0] % bs
    assert torch.equal(tok(k)[keep_b, keep_o], tok(k0)[keep_b, keep_o])
    assert torch.equal(tok(v)[keep_b, keep_o], tok(v0)[keep_b, keep_o])


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_ref_float64_equals_direct_rope(head_dim, scaling):
    c = make_case(head_dim, head_dim, scaling)
    k, v = c["k"].clone(), c["v"].clone()
    realign_kv_ref(k, v, c["src"], c["dst"], c["delta"], c["inv_freq"].double())
    check(c, k, v, c["k"], c["v"], atol=1e-10, rtol=0)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_fp32_equals_direct_rope(head_dim, scaling):
    # Small positions: an fp32 angle pos * inv_freq is itself off by up to ulp(pos) / 2,
    # which is the fp32 noise floor of any RoPE (HF's included); 1e-4 holds below ~1K.
    c = make_case(head_dim + 1, head_dim, scaling, max_pos=1024)
    k0, v0 = c["k"].float(), c["v"].float()
    k, v = k0.clone().to(DEV), v0.clone().to(DEV)
    realign_kv(k, v, c["src"].to(DEV), c["dst"].to(DEV), c["delta"].to(DEV), c["inv_freq"].to(DEV))
    k, v = k.cpu(), v.cpu()
    check(c, k, v, k0, v0, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers_per_program", [None, 2], ids=["auto", "lpp2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_kernel_equals_ref(dtype, layers_per_program):
    # 3 KV heads (padded to 4 in the kernel), large deltas of both signs, and with
    # layers_per_program=2 an uneven layer split (3 layers -> groups of 2 and 1).
    c = make_case(7, 64, LLAMA3, heads=3, max_pos=64000)
    k_ref, v_ref = c["k"].to(dtype), c["v"].to(dtype)
    k, v = k_ref.clone().to(DEV), v_ref.clone().to(DEV)
    rope_realign._launch(k, v, c["src"].to(DEV), c["dst"].to(DEV), c["delta"].to(DEV), c["inv_freq"].to(DEV),
                         layers_per_program)
    realign_kv_ref(k_ref, v_ref, c["src"], c["dst"], c["delta"], c["inv_freq"])
    k, v = k.cpu(), v.cpu()
    assert torch.equal(v, v_ref)
    if dtype == torch.float32:
        torch.testing.assert_close(k, k_ref, atol=2e-6, rtol=2e-6)  # cos/sin implementations differ by ulps
    else:
        # Same fp32 values up to ulps, so the one rounding to 16 bits agrees except at
        # near-ties, where it may differ by one ulp.
        torch.testing.assert_close(k, k_ref, atol=1e-2, rtol=1e-2)
        assert (k != k_ref).float().mean().item() < 0.01


@pytest.mark.parametrize("impl", [realign_kv, realign_kv_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("from_zero", [True, False], ids=["from0", "shifted"])
def test_equals_engine_apply_rope(impl, from_zero):
    """Realigned keys == what the engine's own RoPE (fp32 cos/sin table) gives at the new positions."""
    head_dim, heads, n, block_size, blocks = 64, 2, 16, 4, 10
    g = torch.Generator().manual_seed(11)
    table = cos_sin_table(head_dim, THETA, LLAMA3, 8192, device="cpu")
    inv_freq = inv_frequencies(head_dim, THETA, LLAMA3)
    x = torch.randn(n, heads, head_dim, generator=g)
    # From position 0 the kernel's angle is the very product the table holds, so the
    # results agree to cos/sin ulps even far out; a shifted source adds the fp32 angle
    # error of two positions, bounded at small positions.
    old = torch.zeros(n, dtype=torch.int64) if from_zero else torch.randint(0, 256, (n,), generator=g)
    new = torch.randint(0, 8192 if from_zero else 512, (n,), generator=g)
    cached = x.clone()
    apply_rope_ref(cached.clone(), cached, old, table)  # engine RoPE at the old positions (k in place)
    want = x.clone()
    apply_rope_ref(want.clone(), want, new, table)
    k = torch.randn(1, blocks + 1, heads, block_size, head_dim, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm((blocks + 1) * block_size, generator=g)
    src, dst = perm[:n], perm[n : 2 * n]
    tok(k)[src // block_size, src % block_size] = cached[:, None]
    k, v = k.to(DEV), v.to(DEV)
    impl(k, v, src.to(DEV), dst.to(DEV), (new - old).to(DEV), inv_freq.to(DEV))
    got = tok(k.cpu())[dst // block_size, dst % block_size][:, 0]
    tol = 2e-5 if from_zero else 2e-4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_empty_and_bad_shapes():
    k = torch.zeros(2, 3, 2, 4, 64).to(DEV)
    f = inv_frequencies(64, THETA, None).to(DEV)
    none = torch.zeros(0, dtype=torch.int64, device=DEV)
    for fn in (realign_kv, realign_kv_ref):
        fn(k, k.clone(), none, none, none, f)  # no tokens: a no-op
        with pytest.raises(ValueError):
            fn(k, k.clone(), none, none, none, f[:16])
        with pytest.raises(ValueError):
            fn(k, k[:1].clone(), none, none, none, f)
