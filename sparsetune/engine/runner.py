"""Turns a scheduled `Batch` into tensors, runs the model, and replays CUDA graphs for decode."""

from __future__ import annotations

import torch

from sparsetune.engine.attention import AttentionBackend, AttentionMetadata, ForwardContext
from sparsetune.engine.kv_cache import KVCache
from sparsetune.engine.model import CausalLM
from sparsetune.engine.rows import Rows, RowsBatch
from sparsetune.engine.scheduler import Batch

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        backends: list[AttentionBackend],
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv = kv
        self.backends = backends
        self.device = kv.k.device
        self.block_size = kv.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.max_num_seqs = max_num_seqs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = True  # False: decode runs eagerly even with graphs captured (`Engine.eager`)
        # A prefill's last layer attends and runs its MLP on the rows whose logits are read only (as
        # llama.cpp does); False runs every row (a benchmark's side-by-side baseline).
        self.skip_unused_rows = True
        self.graph_logits: dict[int, torch.Tensor] = {}

    # ---- inputs -------------------------------------------------------------------------------

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def prepare(self, batch: Batch, ids_ahead: torch.Tensor | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """Input ids and metadata of `batch`. `ids_ahead` (a decode batch): one step ahead of the
        sequences, whose last sampled tokens are not appended yet but are these (on the device)."""
        bs = self.block_size
        ahead = 0 if ids_ahead is None else 1
        ids: list[int] = []
        positions, slots = [], []
        seq_lens: list[int] = []
        qsl = [0]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed + ahead
            ids.extend(seq.token_ids[start : start + n])
            # Vectorised: a 32K-token prefill chunk would cost ~20 ms as Python loops.
            pos = torch.arange(start, start + n)
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
        width = max(len(s.block_table) for s in batch.seqs)
        pinned = self.device.type == "cuda"
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            positions=torch.cat(positions).to(self.device, non_blocking=pinned),
            slot_mapping=torch.cat(slots).to(self.device, non_blocking=pinned),
            block_tables=self._block_tables([s.block_table for s in batch.seqs], width),
            seq_lens=self._tensor(seq_lens, torch.int32),
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=qsl,
            seq_ids=[s.seq_id for s in batch.seqs],
        )
        return (self._tensor(ids, torch.int64) if ids_ahead is None else ids_ahead), meta

    def context(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(meta, self.kv, self.backends)

    # ---- execution ------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: Batch, all_logits: bool = False, ids_ahead: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[B, V]` at each sequence's last new token (or `[N, V]` for every token);
        `ids_ahead`: a decode step one ahead of the sequences (`prepare`)."""
        if not batch.is_prefill and self.graphs and self.use_graphs and not all_logits:
            return self._replay(batch, ids_ahead)
        input_ids, meta = self.prepare(batch, ids_ahead)
        last = None if all_logits else meta.last_rows(self.device)
        skip = (last is not None and batch.is_prefill and self.skip_unused_rows
                and all(b.attends_last_rows for b in self.backends))
        hidden = self.model(input_ids, self.context(meta), last=last if skip else None)
        return self.model.compute_logits(hidden if last is None or skip else hidden[last])

    @torch.inference_mode()
    def run_rows(self, batch: Batch) -> torch.Tensor:
        """A prefill step holding planned prefills (`Sequence.plan`), as one `RowsBatch` forward: each
        plan's rows (its reused KV written first) beside the plain prompts' chunks → logits `[B, V]`
        at each sequence's last row. The attention backends do not see this step, so each sequence's
        per-block fields (a decode flow's) are rebuilt over what it wrote."""
        scale = self.model.config.head_dim**-0.5
        members, tables = [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            end = seq.num_computed + n
            if seq.plan is not None:
                members.append(seq.plan.rows(table))
            else:
                members.append(Rows(self.kv, table, end, torch.arange(seq.num_computed, end, device=self.device), scale))
            tables.append((table, end))
        rows = RowsBatch(members)
        ids = torch.cat([torch.tensor(seq.token_ids, device=self.device)[m.positions] for seq, m in zip(batch.seqs, members)])
        hidden = self.model(ids, rows=rows)
        logits = self.model.compute_logits(hidden[rows.last_rows()])
        for table, end in tables:
            self.rebuild_fields(table, end)
        return logits

    def rebuild_fields(self, table: torch.Tensor, num_tokens: int) -> None:
        """Every backend's per-block fields over a sequence's first `num_tokens` tokens (`table`: its
        block table on the device), once its KV was written outside the backends."""
        for layer, backend in enumerate(self.backends):
            backend.rebuild_fields(layer, self.kv, table, num_tokens)

    # ---- CUDA graphs for decode ----------------------------------------------------------------

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES) -> None:
        sizes = sorted({b for b in batch_sizes if b <= self.max_num_seqs} | {min(self.max_num_seqs, max(batch_sizes))})
        n = sizes[-1]
        dev = self.device
        # Static inputs of every graph: rows ids / positions / slots / seq_lens (int64, one H2D copy
        # per step from a pinned staging buffer) and the block tables (updated incrementally).
        self._g_in = torch.zeros(4, n, dtype=torch.int64, device=dev)
        self._g_in[2].fill_(self.kv.null_slot)
        # Two staging buffers, alternating: with overlapped steps the host stages a step before the
        # copy of the one before it has run (Engine.step waits for a step only after the next is queued).
        self._g_stages = [torch.zeros(4, n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._g_turn = 0
        self._g_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._g_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        # Which (sequence, incarnation) each table row holds and how many of its blocks are on the GPU.
        self._g_rows: list[tuple[int, int] | None] = [None] * n
        self._g_row_blocks = [0] * n
        pool = None
        for b in reversed(sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = AttentionMetadata(
                is_prefill=False,
                positions=self._g_in[1, :b],
                slot_mapping=self._g_in[2, :b],
                block_tables=self._g_tables[:b],
                seq_lens=self._g_lens[:b],
                seq_lens_cpu=[1] * b,  # placeholders: decode code in a graph must read tensors only
                query_start_loc_cpu=list(range(b + 1)),
                seq_ids=[],
            )
            ctx = self.context(meta)
            self.model.compute_logits(self.model(self._g_in[0, :b], ctx))  # warm-up: compiles kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.graph_logits[b] = self.model.compute_logits(self.model(self._g_in[0, :b], ctx))
            pool = g.pool()
            self.graphs[b] = g
        self._g_lens.fill_(0)
        torch.cuda.synchronize()

    def _replay(self, batch: Batch, ids_ahead: torch.Tensor | None = None) -> torch.Tensor:
        b = len(batch.seqs)
        size = next((s for s in sorted(self.graphs) if s >= b), None)
        if size is None:  # larger than any captured graph: run eagerly
            input_ids, meta = self.prepare(batch, ids_ahead)
            return self.model.compute_logits(self.model(input_ids, self.context(meta)))
        bs = self.block_size
        ahead = 0 if ids_ahead is None else 1
        ids, pos, slots, lens = [], [], [], []
        for i, seq in enumerate(batch.seqs):
            p = seq.num_tokens - 1 + ahead
            ids.append(0 if ahead else seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            self._sync_table_row(i, seq)
        pad = size - b
        stage = self._g_stages[self._g_turn]
        self._g_turn ^= 1
        stage[:, :size] = torch.tensor(
            [ids + [0] * pad, pos + [0] * pad, slots + [self.kv.null_slot] * pad, lens + [0] * pad]
        )
        self._g_in[:, :size].copy_(stage[:, :size], non_blocking=True)
        if ids_ahead is not None:  # the tokens the step before sampled, still on the device
            self._g_in[0, :b].copy_(ids_ahead)
        self._g_lens[:size].copy_(self._g_in[3, :size])
        self.graphs[size].replay()
        return self.graph_logits[size][:b]

    def _sync_table_row(self, row: int, seq) -> None:
        """Copy only the block-table entries the GPU row lacks (a new block every block_size steps)."""
        key = (seq.seq_id, seq.num_preemptions)  # a preempted sequence comes back with new blocks
        start = self._g_row_blocks[row] if self._g_rows[row] == key else 0
        n = len(seq.block_table)
        if n > start:
            new = torch.tensor(seq.block_table[start:n], dtype=torch.int32, pin_memory=True)
            self._g_tables[row, start:n].copy_(new, non_blocking=True)
        self._g_rows[row] = key
        self._g_row_blocks[row] = n
