"""The generated cache stage: one program per (block, KV head) loads the block's keys and values,
computes the flow's fields and stores them (to the null row when the block is not complete),
replacing a gather, the Inductor kernels and an index_put per field."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from sparsetune.flow.base import FP8_MAX, DecodeFlow
from sparsetune.flow.compile.cache import load_kernel, shared
from sparsetune.flow.compile.emit import Emitter, kernel_source, p2, ptr_params, with_strides
from sparsetune.flow.compile.layout import KVLayout
from sparsetune.flow.compile.paged import paged_layout
from sparsetune.flow.trace import tracing
from sparsetune.flow.shapes import dummy_inputs


@dataclass(frozen=True)
class CacheKernel:
    """A generated cache stage and what to pass it."""

    source: str
    fields: tuple[str, ...]
    consts: tuple[str, ...]
    layout: KVLayout

    @cached_property
    def kernel(self) -> object:
        return load_kernel(self.source, "flow_cache")

    def __call__(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
        stores: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
    ) -> None:
        """Fields of the blocks at rows `src` (one per program) written to rows `dst`."""
        self._launch(k_pool, v_pool, self.layout.copy_args(src, dst), src.numel(), False, stores, consts)

    def decode(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, positions: torch.Tensor, blocks: object,
        seq_lens: torch.Tensor, stores: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
    ) -> None:
        """A decode step: each request's block holding `positions[i]`, stored only if that token
        completes it (else to the null row): no index arithmetic outside the kernel. `blocks`:
        the step's block map of the layout (paged: `PagedBlocks`)."""
        args = self.layout.decode_args(positions, blocks, seq_lens)
        self._launch(k_pool, v_pool, args, positions.numel(), True, stores, consts)

    def _launch(self, k_pool, v_pool, where: list[object], n: int, from_positions: bool, stores, consts) -> None:
        hkv = k_pool.shape[1]
        args: list[object] = [hkv, *where, *self.layout.pool_args(k_pool), *self.layout.pool_args(v_pool)]
        args += [a for name in self.fields for a in with_strides(stores[name])]
        args += [a for name in self.consts for a in with_strides(consts[name])]
        self.kernel[(n * hkv,)](*args, FROM_POSITIONS=from_positions, num_warps=4)  # type: ignore[index]


def fp8_round(val: str, out: str) -> list[str]:
    """Statements setting `out` to the fp32 tile `val` rounded to e4m3 as `flow.base.to_store` does
    (clamped to +-448, then to the nearest value, ties to even; subnormals below 2**-6 in steps of
    2**-9), in exact fp32 arithmetic: the exponent read from the bits, a power-of-two scale built
    from bits (no division), and the round-to-even of adding and subtracting 1.5 * 2**23. So the
    store's own cast to 8 bits is exact, on any GPU and under the interpreter (whose cast rounds ties
    up)."""
    return [f"{out} = tl.minimum(tl.abs({val}), {FP8_MAX})",
            f"{out}_e = tl.maximum((({out}.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)",  # e4m3's exponent
            f"{out}_up = ((130 - {out}_e) << 23).to(tl.float32, bitcast=True)",  # 2 ** (3 - e): 3 mantissa bits
            f"{out}_down = (({out}_e + 124) << 23).to(tl.float32, bitcast=True)",  # 2 ** (e - 3)
            f"{out} = (({out} * {out}_up + 12582912.0) - 12582912.0) * {out}_down",
            f"{out} = tl.where({val} < 0, -{out}, {out})"]


def build_cache(flow: DecodeFlow, head_dim: int, layout: KVLayout | None = None) -> CacheKernel:
    """The generated cache stage of this flow and head_dim (raises NotBlockLocal), one object per
    generated code. Compiled on first call. `layout`: as `build_indexer`'s."""
    layout = layout or paged_layout(flow)
    bs = flow.unit
    x = dummy_inputs(flow, head_dim)
    inputs = {id(x.k): ("k_in", False), id(x.v): ("v_in", False)}
    inputs.update({id(t): (f"c_{n}", False) for n, t in x.const.items()})
    with tracing() as t:
        out = flow.run_cache(x.k, x.v, x.const)
    em = Emitter(inputs)
    em.emit(t.nodes)
    sig = ["HKV", *layout.cache_params(), *layout.pool_params("k"), *layout.pool_params("v")]
    loads = [line for p in ("k", "v") if f"{p}_in" in em.used for line in layout.token_tile(f"{p}_in", p, bs, head_dim, False)]
    consts_used, const_params, const_loads = em.const_loads(x.const)
    loads += const_loads
    stores: list[str] = []
    names = tuple(out)
    for n in names:
        val = em.tensor(out[n]).name
        if flow.field_dtype == "fp8":
            stores += fp8_round(val, f"q8_{n}")
            val = f"q8_{n}"
        r, c = out[n].shape[1:]
        ri, ci = f"tl.arange(0, {p2(r)})", f"tl.arange(0, {p2(c)})"
        stores.append(
            f"tl.store(f_{n}_ptr + dst_blk * f_{n}_s0 + h * f_{n}_s1 + {ri}[None, :, None] * f_{n}_s2"
            f" + {ci}[None, None, :] * f_{n}_s3, {val},"
            f" mask=({ri} < {r})[None, :, None] & ({ci} < {c})[None, None, :])"
        )
    sig += [p for n in names for p in ptr_params(f"f_{n}", 4)] + const_params
    lines = ["row = tl.program_id(0)", "i = row // HKV", "h = row % HKV", *layout.cache_rows(bs),
             *loads, *em.body, *stores]
    doc = f"Generated by sparsetune.flow.compile: the cache stage of flow {flow.name!r} (head_dim {head_dim})."
    src = kernel_source("flow_cache", sig + ["FROM_POSITIONS: tl.constexpr"], lines, doc)
    return shared(CacheKernel(src, names, consts_used, layout))
