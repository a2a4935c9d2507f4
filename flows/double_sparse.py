"""DoubleSparse (Yang et al., 2024, arXiv 2408.07092; andy-yang-1/DoubleSparse), at block level.

Offline calibration ranks each head's channels by mean|q⊙k| (post-RoPE, same position) over
calibration text (`sparsetune flows calibrate`). At runtime a "label cache" keeps every key
restricted to its head's r most important channels (the paper's r = head_dim / group_factor),
and each decode step scores keys by q[chans]·k_label and attends only to the top ones. The first
two layers stay dense.

Cache stage: the block's keys restricted to the calibrated channels, the label `[1, block, r]`
(2·block·r bytes per block instead of 2·block·head_dim for full keys). Indexer: a block's score
is the max over its tokens and over the KV head's query group of q[chans]·k_label.

Differences from the original: selection is per KV block (`block_size=1` is token level, as
the paper) and per KV head, so a GQA group shares one selection and one channel order (the
statistic is summed over the group), where the original ranks tokens per query head; the
label cache is not quantized (the paper's `label_bits`); the always-kept sink and local
blocks come from the runtime, and the 1/√r score scale is dropped (top-k does not need it).
"""

from sparsetune.flow import DecodeFlow, Param, Search
from sparsetune.flow import ops as F


class DoubleSparse(DecodeFlow):
    name = "double_sparse"
    source = "DoubleSparse, arXiv 2408.07092"
    calibrated = True
    calibration = Param("auto", doc="channel calibration file; auto: the default one of the model "
                        "(`sparsetune flows calibrate --model M`)")
    channels = Param(16, choices=(4, 8, 16, 32, 64, 128), doc="label channels r per key (at most head_dim)",
                     search=Search(choices=(4, 8, 16, 32, 64)))
    dense_layers = Param((0, 1), kind=tuple, doc="layers that keep full attention (DoubleSparse: the first two)")

    def cache(self, k, v, const):
        return {"label": F.gemm(k, const["channels"])}  # [1, block, r]: each key on its top channels

    def index(self, q, fields, const):
        ql = F.gemm(q, const["channels"])  # [1, G, r]
        logits = F.gemm(fields["label"], ql)  # [S, block, G]
        return F.topk(F.max(F.max(logits, dim=1), dim=2))  # [S, 1, 1]
