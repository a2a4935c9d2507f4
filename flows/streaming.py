"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks + a recent window.

Rule (mit-han-lab/streaming-llm `StartRecentKVCache`): keep the first `start_size` tokens
(4 sinks) and the last `recent_size` tokens; the middle is never attended. Here at block
granularity: the first `sink_blocks` blocks (one block of 16 covers the 4 sink tokens) and
the last `local_blocks` blocks. Positions stay absolute (the cached keys keep their RoPE).
"""

from sparsetune.flow import DecodeFlow, Param, Search
from sparsetune.flow import ops as F


class Streaming(DecodeFlow):
    name = "streaming"
    source = "StreamingLLM, arXiv 2309.17453"
    local_blocks = Param(128, low=1, high=1 << 16, log=True, doc="recent window in blocks (2048 tokens at block 16)",
                         search=Search(low=4, high=512, log=True))
    inapplicable = {k: "it attends the sink blocks and a recent window only; size the window with "
                    "--param local_blocks=N (blocks)" for k in ("budget", "budget_ratio")}

    def index(self, q, fields):
        return F.keep_only_forced()
