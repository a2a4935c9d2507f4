"""Continuous batching: chunked prefill first, else one decode token for every running sequence.

`interleave=True` (latency under load, `EngineConfig.schedule = "interleave"`): after a prefill
step, the running sequences take a decode step before the next prefill chunk, so a long prompt
arriving stalls their tokens by one chunk's time, not by its whole prefill. That interleaved step
never preempts: a sequence that cannot get its next block waits for a regular decode step.

Preemption is by recompute: when a decode step cannot get a block, the most
recently admitted running sequence gives up its blocks and goes back to the
front of the waiting queue with all its tokens (prompt + generated) as its new
prompt. Its KV is recomputed later; nothing already generated changes.

A request with a plan (`Sequence.plan`, a `PlannedPrefill`: a reuse request) is admitted in the same
queue. When the scheduler first reaches it, the plan takes what it reuses and may return
cache-building requests (a stored segment's fill), queued just before it; the request runs once they
have; with prefix caching, its prompt first takes the cached blocks it starts with, as a plain
prompt does (a prefix, then segments). It is never chunked: it takes its whole prompt's blocks and `num_rows()` of the step's token
budget, shares the step with other plans and plain chunks while the budget lasts, and runs alone in
a step when its rows exceed the budget (a 32K prompt whose plan computes every row of a layer). A
planned request only runs in one prefill step, so it is never preempted mid-prefill; preempted while
decoding, it is recomputed in full like any other (its KV then exact, not the plan's).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sparsetune.engine.block_manager import BlockManager
from sparsetune.engine.sequence import Sequence, Status
from sparsetune.errors import SparsetuneError


@dataclass
class Batch:
    is_prefill: bool
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed this step per sequence

    def completes_prefill(self, i: int) -> bool:
        s = self.seqs[i]
        return s.num_computed + self.num_new_tokens[i] == s.num_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 interleave: bool = False) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.interleave = interleave
        self._after_prefill = False  # the last batch was a prefill (interleave: decode next)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        if self.interleave and self._after_prefill:
            self._after_prefill = False
            batch = self._decode_with_room()
            if batch.seqs:
                return batch
        batch = self._schedule_prefill()
        self._after_prefill = batch is not None
        return batch if batch is not None else self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        blocked = False  # a request found no room: the ones after it wait (first come, first served), fills go on
        i = 0
        while i < len(self.waiting):
            seq = self.waiting[i]
            if budget == 0 or len(self.running) + len(seqs) >= self.max_num_seqs:
                break
            plan = seq.plan
            if blocked and (plan is None or not plan.cache_only):
                i += 1
                continue
            if plan is not None:
                if not seq.admitted:
                    if not self._admit_plan(seq, i):
                        blocked = True
                        i += 1
                    continue  # admitted: its fills, queued at i, come first
                if not plan.ready():  # its segments are still being filled
                    i += 1
                    continue
                rows = plan.num_rows()
                if seqs and rows > budget:
                    break
                seqs.append(seq)
                counts.append(seq.num_tokens - seq.num_computed)
                budget = max(0, budget - rows)
                i += 1
                continue
            if not seq.block_table:  # a new (or preempted) sequence: take the blocks of a cached prefix
                self.blocks.match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            if not self.blocks.can_grow(seq, seq.num_computed + chunk):
                blocked = True
                i += 1
                continue
            self.blocks.grow(seq, seq.num_computed + chunk)
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk
            if chunk < remaining:  # a chunked prompt occupies the rest of this step
                break
            i += 1
        return Batch(True, seqs, counts) if seqs else None

    def _admit_plan(self, seq: Sequence, i: int) -> bool:
        """Admit the planned request at `waiting[i]`: the cached prefix its prompt starts with, what it
        reuses, its own blocks (held while its fills run, so admitted requests never over-commit the
        pool), its fills queued before it. False (only the prefix held) when the pool has no room for it yet."""
        plan = seq.plan
        if not plan.cache_only and not seq.block_table:  # a prompt may hit a cached prefix, then segments
            self.blocks.match_prefix(seq)
        fills = plan.admit(seq.num_computed)
        if fills is None:
            return False
        if not self.blocks.can_grow(seq, seq.num_tokens):
            plan.cancel()
            for f in fills:
                f.plan.cancel()
            return False
        self.blocks.grow(seq, seq.num_tokens)
        seq.admitted = True
        for f in reversed(fills):
            self.waiting.insert(i, f)
        return True

    def _decode_with_room(self) -> Batch:
        """The interleaved decode step: the running sequences whose next token has room, in order
        (each takes its block before the next one asks); the others wait. Never preempts."""
        seqs: list[Sequence] = []
        for s in self.running:
            if len(seqs) == self.max_num_seqs:
                break
            if self.blocks.can_grow(s, s.num_tokens):
                self.blocks.grow(s, s.num_tokens)
                seqs.append(s)
        return Batch(False, seqs, [1] * len(seqs))

    def _schedule_decode(self) -> Batch:
        seqs: list[Sequence] = []
        while self.running and len(seqs) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.blocks.can_grow(seq, seq.num_tokens):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.grow(seq, seq.num_tokens)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        if not seqs and self.waiting and not self.running:
            # Everything was preempted: the head of the queue must fit on its own.
            head = self.waiting[0]
            what = " with the segments it reuses" if head.plan is not None else ""
            raise SparsetuneError(f"a {head.num_tokens}-token request{what} does not fit in the KV pool "
                                  f"({self.blocks.num_blocks} blocks of {self.blocks.block_size}); raise --kv-memory")
        return Batch(False, seqs, [1] * len(seqs))

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.cacheable = True  # recomputed in full: exact KV, whatever wrote it before
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: Batch, sampled: dict[int, int], eos_ids: tuple[int, ...], max_model_len: int) -> list[Sequence]:
        """Advance sequences after a step; append sampled tokens; return those that finished."""
        finished: list[Sequence] = []
        for i, seq in enumerate(batch.seqs):
            done_prefill = batch.completes_prefill(i)
            seq.num_computed += batch.num_new_tokens[i]
            self.blocks.commit(seq)
            if batch.is_prefill and not done_prefill:
                continue  # mid-prompt chunk: nothing sampled yet
            if seq.plan is not None:
                plan, seq.plan = seq.plan, None
                if plan.cache_only:  # a fill: its blocks are the cache's now, nothing to sample
                    self.waiting.remove(seq)
                    seq.block_table = []
                    seq.status = Status.FINISHED
                    seq.finish_reason = "stored"
                    continue
            if batch.is_prefill:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.status = Status.RUNNING
            if self.append_token(seq, sampled[seq.seq_id], eos_ids, max_model_len):
                finished.append(seq)
        return finished

    def admit_running(self, seq: Sequence, num_computed: int) -> None:
        """Admit a sequence whose blocks already hold the KV of its first `num_computed` tokens (a
        prefill done outside the step loop) straight into the running set."""
        seq.num_computed = num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)

    def abort(self, seq: Sequence) -> bool:
        """Take a request out wherever it is and free its blocks; False if it had already finished."""
        if seq.status == Status.FINISHED:
            return False
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.plan is not None:  # aborted before its planned prefill ran
            if seq.plan.cache_only:
                seq.block_table = []  # the cache's blocks: `cancel` gives them back
            seq.plan.cancel()
            seq.plan = None
        self.blocks.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        for f in [f for f in self.waiting if f.plan is not None and f.plan.cache_only and not f.plan.wanted()]:
            self.abort(f)  # fills nobody waits for any more
        return True

    def append_token(self, seq: Sequence, tok: int, eos_ids: tuple[int, ...], max_model_len: int) -> bool:
        """Append a sampled token to a running sequence; finish it (freeing its blocks) when it stops."""
        seq.token_ids.append(tok)
        p = seq.params
        reason = None
        if not p.ignore_eos and (tok in eos_ids or tok in p.stop_token_ids):
            reason = "stop"
        elif seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
            reason = "length"
        if reason:
            seq.finish_reason = reason
            seq.status = Status.FINISHED
            self.running.remove(seq)
            self.blocks.release(seq)
        return reason is not None
