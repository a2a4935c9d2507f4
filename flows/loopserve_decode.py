"""LoopServe's progressive KV selection while decoding (arXiv 2507.13681, Alg. 3), at block level.

Every `interval` (n_d) decode steps the input is re-selected from the attention of the latest
output queries: each step adds, per KV head and block, the exact attention mass the current
query gives the block (Σ over the block's tokens of softmax(q·k/√d), summed over the head's query
group) to a window total; when `interval` steps have passed, the window total becomes the frozen
selection score and the window restarts. Until the first re-selection, each step selects by the
mass accumulated so far. The budget (`budget`, the paper's B = 1024 tokens) is filled with the
top blocks of the frozen score; the runtime's sink and local blocks keep the newest outputs.
Differences from the paper: blocks instead of tokens (`block_size=1` is token level), one
selection per KV group instead of per query head, and the first selection is not delayed to step 16.
The empty slots of the sequence's last, partial block read as zero keys (logit 0), so they add
exp(-max logit) each to that block's share (as in `tidal`); the block is always kept anyway.
The prefill side is the `loopserve` reuse flow, which installs this flow when no --flow is given.
"""

from sparsetune.flow import DecodeFlow, Param
from sparsetune.flow import ops as F


class LoopServeDecode(DecodeFlow):
    name = "loopserve_decode"
    source = "LoopServe, arXiv 2507.13681"
    uses_keys = True
    budget = Param(1024, low=1, high=1 << 22, log=True, doc="tokens attended per step (the paper's B)")
    # At most 256: the step counter is a field in the pool's dtype, and bf16 counts exactly only to 256.
    interval = Param(16, low=1, high=256, doc="decode steps between re-selections (the paper's n_d)")

    def cache(self, k, v):
        zero = F.fill(F.sum(F.mean(k, dim=1), dim=2), 0.0)  # [1, 1, 1]
        return {"window": zero, "chosen": zero, "tick": zero, "armed": zero}

    def index(self, q, fields):
        logits = F.gemm(fields["k"], q)  # [S, block, G]
        peak = F.max(F.max(logits, dim=1), dim=0)  # [1, 1, G]
        mass = F.sum(F.exp(F.scale(F.sub(logits, peak), alpha=q.shape[2] ** -0.5)), dim=1)  # [S, 1, G]
        window = F.add(fields["window"], F.sum(F.normalize(mass, dim=0), dim=2))  # [S, 1, 1]
        tick = F.add(F.max(fields["tick"], dim=0), 1.0)  # steps since the last re-selection (shared)
        due = F.ge(tick, float(self.interval))  # [1, 1, 1]
        chosen = F.where(due, window, fields["chosen"])
        armed = F.where(due, 1.0, F.max(fields["armed"], dim=0))  # a re-selection has happened
        zero = F.fill(window, 0.0)
        F.save(fields, "chosen", chosen)
        F.save(fields, "window", F.where(due, zero, window))
        F.save(fields, "tick", F.add(zero, F.where(due, 0.0, tick)))
        F.save(fields, "armed", F.add(zero, armed))
        return F.topk(F.where(F.gt(armed, 0.5), chosen, window))
