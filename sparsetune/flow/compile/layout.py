"""`KVLayout`: how generated kernels find a request's KV blocks and a block's fields in storage."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class KVLayout(Protocol):
    """A KV storage target of the generated kernels (`paged.PagedLayout` is this engine's).

    The emitted code is layout-agnostic: it sees *logical* blocks (block j of request b holds its
    tokens [j*bs, (j+1)*bs)) and, for each, a *row*: the block's index into the flow's field
    stores `[rows, Hkv, r, c]` (one row per stored block, plus a null row that absorbs writes
    that complete nothing). A layout says how to get rows and tokens, as Triton statements over
    names the kernels set, and the launch arguments that fill its parameters. It is a value
    (hashable, equal when it generates the same code): kernels are shared by equal layouts.

    Names the kernels set before the layout's statements: indexer `b` (request), `h` (KV head),
    `j` (`[BLOCK_S]` logical blocks), `seq_len`, `nb` (blocks of b), `live` (`j < nb`), `W` (the
    block map's width); cache stage `i` (the program's block, or its request in decode), `h`, and
    the constexpr `FROM_POSITIONS` (decode). Names the layout's statements must set: indexer `blk` (`[BLOCK_S]`
    int64 rows of blocks j; for lanes not `live`, a row safe to read); cache stage `blk` (the row
    whose K/V are read) and `dst_blk` (the row written: the null row when nothing completes).
    A layout may set further names of its own for `token_tile`.

    SGLang's pool (flat K/V `[slots, Hkv, D]`, `req_to_token[req, pos] -> slot`) needs no layout of
    its own when its page size is the flow's block size: its buffers viewed `[pages, Hkv, P, D]`
    (strided, not copied) with a page table `req_to_token[req_pool_indices, ::P] // P` are a paged
    pool, pages the field rows, for the generated stages and the sparse attention kernel alike
    (`tests/flow/test_indexer_kernels.py::test_sglang_pool_runs_through_the_paged_layout`). A
    token-paged layout (the test's `TokenLayout`) would serve a pool whose pages are not blocks.
    """

    def grid(self, blocks: Any) -> tuple[int, int]:
        """(requests, logical block columns) of a step's block map `blocks`."""
        ...

    def index_params(self) -> list[str]:
        """The indexer's kernel parameters that locate blocks."""
        ...

    def index_rows(self, block_size: int) -> list[str]:
        """Indexer statements setting `blk`."""
        ...

    def index_args(self, blocks: Any) -> list[object]:
        """Launch arguments for `index_params`, from a step's block map."""
        ...

    def cache_params(self) -> list[str]:
        """The cache stage's kernel parameters that locate its blocks (both modes)."""
        ...

    def cache_rows(self, block_size: int) -> list[str]:
        """Cache-stage statements setting `blk` and `dst_blk`, for both values of FROM_POSITIONS."""
        ...

    def copy_args(self, src: torch.Tensor, dst: torch.Tensor) -> list[object]:
        """`cache_params` arguments to read blocks `src` and write their fields to rows `dst`."""
        ...

    def decode_args(self, positions: torch.Tensor, blocks: Any, seq_lens: torch.Tensor) -> list[object]:
        """`cache_params` arguments for a decode step (FROM_POSITIONS): each request's block
        holding its new token `positions[i]`, written only if that token completes it."""
        ...

    def pool_params(self, var: str) -> list[str]:
        """Kernel parameters of one K or V pool, named after `var`."""
        ...

    def pool_args(self, pool: torch.Tensor) -> list[object]:
        """Launch arguments for `pool_params`."""
        ...

    def token_tile(self, var: str, pool: str, block_size: int, head_dim: int, over_s: bool, extra: str = "") -> list[str]:
        """Statements setting `var`: the fp32 tile `[BLOCK_S or 1, block_size, head_dim]` (0 where
        masked) of KV head `h` in pool `pool` (as named in `pool_params`): the indexer's blocks `j`
        when `over_s`, else the cache stage's block; `extra` (`& <[S, bs, 1] mask>`) masks more."""
        ...
