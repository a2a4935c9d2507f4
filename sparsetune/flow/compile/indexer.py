"""The generated indexer: one program owns `BLOCK_S` blocks of one (request, KV head) row, or
`TILES` x `BLOCK_S` of them, a tile at a time, where the flow has costly math over the query and
constants alone (a calibrated flow's query on its channels: a product, and constants to load), which
a program then computes once. Elementwise math of the query alone (Quest's positive and negative
parts) costs a program a few register operations: such a kernel stays a program a tile, which
keeps more of them in flight (Quest's scoring, H100: 45% of its byte floor tiled, 87-91% at one
tile a program; BENCHMARKS.md, #43).

With `candidates` (the second level of a two-level flow) a row scores the units of its chosen
blocks instead of every unit of its sequence: given the first level's blocks `pages[r, :kept[r]]`
(logical block indices), entry c = i * U + u of row r is unit u of block `pages[r, i]`, i.e. logical
unit `pages[r, i] * U + u` (`flow.stages.candidate_units`); entries with i >= kept[r] are dead. A
program owns `BLOCK_S` entries; each score is masked as above by its unit's own index, and the
row's count is capped at its live entries (the last block is always among the chosen: it holds
the newest token).

It loads the group's query heads once and each block's fields once (the group shares them;
Inductor's fused reduction re-read them per query head), evaluates the flow's indexer in fp32
registers, and writes the row's masked score (always-kept blocks +inf, blocks past the sequence
-inf, NaN → lowest) and its block count for the radix-select top-k
(`sparsetune.kernels.select_topk`). The budget rule (`BudgetRule`) is read from a device
tensor, so one binary, and one captured graph, serves every budget, sink and local setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import triton
import triton.language as tl

from sparsetune.flow.base import FP8, BudgetRule, DecodeFlow
from sparsetune.flow.compile.cache import load_kernel, shared
from sparsetune.flow.compile.emit import Emitter, ForcedOnly, NotBlockLocal, kernel_source, p2, ptr_params, tile_load, with_strides
from sparsetune.flow.compile.layout import KVLayout
from sparsetune.flow.compile.paged import paged_layout
from sparsetune.flow.trace import tracing
from sparsetune.kernels.limits import num_sms
from sparsetune.flow.shapes import dummy_inputs, field_dims

ELEMS_PER_PROGRAM = 16384  # the largest intermediate of one program, in fp32 elements (4 warps)
NUM_WARPS = 4
# A tiled kernel (costly row math of its own, e.g. a calibrated flow's projected query) keeps this many programs
# an SM, each scoring up to MAX_TILES x BLOCK_S entries (`IndexerKernel.tiles`).
PROGRAMS_PER_SM = 4
MAX_TILES = 16
# A centroid-times-query product over 16-bit stores runs on tensor cores (`Emitter.dot_matvec`).
DOT_PRODUCTS = True
_DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_F32_MAX = "3.4028234663852886e38"


@dataclass(frozen=True)
class IndexerKernel:
    """A generated indexer and what to pass it; `__call__` returns masked scores `[B*Hkv, W]`
    (fp32) and the number of blocks each row attends `[B*Hkv]` (int32)."""

    source: str
    fields: tuple[str, ...]
    consts: tuple[str, ...]
    uses_keys: bool
    block_s: int
    layout: KVLayout
    block_s_dot: int = 0  # BLOCK_S of the tensor-core form of its products (`Emitter.dot_matvec`); 0: none
    # A candidates kernel: units per chosen block, whose units it scores (`pages`); 0: every unit of the sequence.
    candidate_units: int = 0
    # Costly row math of its own (a product, or constants): a program scores `tiles` x BLOCK_S entries.
    tiled: bool = False

    @cached_property
    def kernel(self) -> object:
        return load_kernel(self.source, "flow_indexer")

    def __call__(
        self, q: torch.Tensor, blocks: object, seq_lens: torch.Tensor, stores: dict[str, torch.Tensor],
        k_pool: torch.Tensor | None, consts: dict[str, torch.Tensor], hkv: int, rule: torch.Tensor,
        pages: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`blocks`: the step's block map of the layout (paged: `PagedBlocks`); `rule`: the budget
        rule's device tensor (`BudgetRule.tensor`); `pages`: a candidates kernel's chosen blocks
        `[B*Hkv, Kp]` and how many count `[B*Hkv]` (int32), whose units' scores come back `[B*Hkv, Kp * U]`."""
        assert (pages is not None) == bool(self.candidate_units)
        b, width = self.layout.grid(blocks)
        rows = b * hkv
        cols = width if pages is None else pages[0].shape[1] * self.candidate_units
        out = torch.empty(rows, cols, dtype=torch.float32, device=q.device)
        counts = torch.empty(rows, dtype=torch.int32, device=q.device)
        args: list[object] = [q, q.stride(0), q.stride(1), seq_lens, out, out.stride(0), counts, width, hkv, rule,
                              *self.layout.index_args(blocks)]
        if pages is not None:
            args += [pages[0], pages[0].stride(0), pages[1], cols]
        args += [a for name in self.fields for a in with_strides(stores[name])]
        if self.uses_keys:
            assert k_pool is not None
            args += self.layout.pool_args(k_pool)
        args += [a for name in self.consts for a in with_strides(consts[name])]
        block_s, dot_t = self.tile(q, stores)
        tiles = self.tiles(rows, -(-cols // block_s), q.device)
        if self.tiled:
            args.append(tiles)
        grid = (rows, -(-cols // (block_s * tiles)))
        self.kernel[grid](*args, BLOCK_S=block_s, DOT=dot_t is not None, DOT_T=dot_t or tl.float32,  # type: ignore[index]
                          num_warps=NUM_WARPS)
        return out, counts

    def tiles(self, rows: int, per_row: int, device: torch.device) -> int:
        """How many BLOCK_S tiles a program of a tiled kernel scores, given `rows` of `per_row` tiles:
        as many as leave `PROGRAMS_PER_SM` programs on every SM (at most `MAX_TILES`, and no more
        than a row has), so the row math is paid once per program where the SMs stay full. 1 untiled."""
        if not self.tiled:
            return 1
        return max(1, min(MAX_TILES, per_row, rows * per_row // (PROGRAMS_PER_SM * num_sms(device))))

    def tile(self, q: torch.Tensor, stores: dict[str, torch.Tensor]) -> tuple[int, object | None]:
        """BLOCK_S of a launch on these tensors, and the dtype of its tensor-core products (None: the
        broadcast form)."""
        dot_t = self.dot_dtype(q, [stores[n] for n in self.fields])
        return (self.block_s if dot_t is None else self.block_s_dot), dot_t

    def dot_dtype(self, q: torch.Tensor, fields: list[torch.Tensor]) -> object | None:
        """The dtype of the tensor-core products, where they run: the query in a 16-bit float dtype
        and every field stored in it or in 8 bits (e4m3, whose values both 16-bit dtypes hold), so
        that dtype holds the loaded values exactly, and `DOT_PRODUCTS` on. Under the interpreter
        (whose 16-bit `tl.dot` is not exact) the same code in exact fp32."""
        if not (self.block_s_dot and DOT_PRODUCTS and q.dtype in _DOT_TYPES
                and all(f.dtype in (q.dtype, FP8) for f in fields)):
            return None
        return tl.float32 if triton.knobs.runtime.interpret else _DOT_TYPES[q.dtype]


def build_indexer(flow: DecodeFlow, group: int, head_dim: int, layout: KVLayout | None = None,
                  candidates: bool = False) -> IndexerKernel:
    """The generated indexer of this flow and shapes (raises NotBlockLocal, or ForcedOnly), the
    same object for every flow that generates the same code: flows differing only in budget,
    sink or local blocks share it. Compiled on first call. `layout`: default the engine's paged
    pool, its blocks split into the flow's selection units (`paged_layout`). `candidates`: the
    kernel scores a list of units per row (a two-level flow's second level)."""
    layout = layout or paged_layout(flow)
    bs = flow.unit
    x = dummy_inputs(flow, head_dim)
    dims = field_dims(flow, head_dim)
    q, fields = x.index(dims, group)
    inputs = {id(q): ("q_in", False)}
    inputs.update({id(dict.__getitem__(fields, n)): (f"f_{n}", True) for n in dims})
    if flow.uses_keys:
        inputs[id(dict.__getitem__(fields, "k"))] = ("k_in", True)
    inputs.update({id(t): (f"c_{n}", False) for n, t in x.const.items()})
    with tracing() as t:
        sel = flow.run_index(q, fields, x.const)
    if fields.saved:
        raise NotBlockLocal("it saves state (F.save)")
    if sel.score is None:
        raise ForcedOnly("it selects no scored blocks (keep_only_forced)")
    em = Emitter(inputs, allow_dot=True)
    em.emit(t.nodes)
    sv = em.tensor(sel.score)
    if sv.is_bool:
        raise NotBlockLocal("the score is boolean")
    score = sv.name if sv.s else f"({sv.name} + tl.zeros([BLOCK_S, 1, 1], tl.float32))"
    block_s, block_s_dot = (1 << (n.bit_length() - 1) for n in
                            (max(1, min(64, ELEMS_PER_PROGRAM // big)) for big in (em.biggest, em.biggest_dot)))
    block_s_dot = block_s_dot if em.dots and block_s_dot >= 16 else 0  # tl.dot takes >= 16 rows

    sig = ["q", "stride_qb", "stride_qh", "seq_lens", "out", "stride_o", "counts", "W", "HKV", BudgetRule.TRITON_PARAM,
           *layout.index_params(), *(["pages", "stride_p", "kept", "C"] if candidates else [])]
    row_loads = [tile_load("q_in", "q", f"b * stride_qb + h * {group} * stride_qh", group, head_dim, "stride_qh", "1", False)]
    block_loads = []
    fields_used = tuple(n for n in dims if f"f_{n}" in em.used)
    for n in fields_used:
        sig += ptr_params(f"f_{n}", 4)
        block_loads.append(tile_load(f"f_{n}", f"f_{n}_ptr", f"blk * f_{n}_s0 + h * f_{n}_s1", *dims[n],
                                     f"f_{n}_s2", f"f_{n}_s3", True))
    uses_keys = "k_in" in em.used
    if uses_keys:
        sig += layout.pool_params("k")
        live = f" & ((j[:, None, None] * {bs} + tl.arange(0, {p2(bs)})[None, :, None]) < seq_len)"
        block_loads += layout.token_tile("k_in", "k", bs, head_dim, True, live)
    consts_used, const_params, const_loads = em.const_loads(x.const)
    sig += const_params
    row_loads += const_loads
    # With costly math of its own over the query and constants (a product, or constants to load: a
    # calibrated flow's projected query), a program computes it once and scores TILES x BLOCK_S
    # entries in a loop (`IndexerKernel.tiles`), instead of once per BLOCK_S of them; else (none, or
    # elementwise math of the query alone) a program scores one BLOCK_S.
    tiled = bool(em.row_math) and (em.row_products or bool(consts_used))
    first = "(tl.program_id(1) * TILES + t) * BLOCK_S" if tiled else "tl.program_id(1) * BLOCK_S"
    # Entry `col` of the row holds the score of logical unit j: the same unit, or unit col % U of
    # chosen block col // U (dead past the row's kept blocks; j 0 stands in).
    units = flow.block_size // bs
    entries = ([f"col = {first} + tl.arange(0, BLOCK_S)",
                f"chosen = (col < C) & (col // {units} < n_kept)",
                f"j = tl.load(pages + row * stride_p + col // {units}, mask=chosen, other=0) * {units} + col % {units}",
                "live = chosen & (j < nb)",
                "j = tl.where(chosen, j, 0)"] if candidates else
               [f"j = {first} + tl.arange(0, BLOCK_S)", "col = j", "live = j < nb"])
    # A candidates row attends no more units than its chosen blocks hold: all U of each, but the
    # last block's units past the sequence (that block is always chosen).
    cap = ([f"want = tl.minimum(want, n_kept * {units} - ((seq_len + {flow.block_size - 1}) // {flow.block_size}) * "
            f"{units} + nb)"] if candidates else [])
    per_block = [
        *entries,
        *layout.index_rows(bs),
        *block_loads,
        *em.per_block,
        f"sc = tl.reshape({score}, (BLOCK_S,))",
        f"sc = tl.where(sc != sc, -{_F32_MAX}, sc)",
        f"sc = tl.minimum(tl.maximum(sc, -{_F32_MAX}), {_F32_MAX})",
        "sc = tl.where((j < SINK) | (j >= nb - LOCAL), float('inf'), sc)",
        "sc = tl.where(live, sc, float('-inf'))",
        f"tl.store(out + row * stride_o + col, sc, mask=col < {'C' if candidates else 'W'})",
    ]
    lines = [
        "row = tl.program_id(0)",
        "b = row // HKV",
        "h = row % HKV",
        "seq_len = tl.load(seq_lens + b)",
        f"nb = (seq_len + {bs - 1}) // {bs}",
        *(["n_kept = tl.load(kept + row)"] if candidates else []),
        *BudgetRule.TRITON_LOAD,
        *row_loads,
        *em.row_math,
        *(["for t in range(TILES):", *(f"    {line}" for line in per_block)] if tiled else per_block),
        *BudgetRule.TRITON,
        *cap,
        "tl.store(counts + row, want, mask=tl.program_id(1) == 0)",
    ]
    doc = f"Generated by sparsetune.flow.compile: the indexer of flow {flow.name!r} (group {group}, head_dim {head_dim})."
    sig += ["TILES"] if tiled else []
    src = kernel_source("flow_indexer", sig + [f"{c}: tl.constexpr" for c in ("BLOCK_S", "DOT", "DOT_T")], lines, doc)
    return shared(IndexerKernel(src, fields_used, consts_used, uses_keys, block_s, layout, block_s_dot,
                                units if candidates else 0, tiled))
