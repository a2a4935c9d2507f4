"""Shapes the kernels accept, importable without triton (the CPU cost model reads them)."""

TOPK_MAX_WIDTH = 16384 + 1024  # widest row the radix select holds in registers that ran on a GPU (a 32K context at 2-token units: ~16.4K); wider rows: torch's top-k
