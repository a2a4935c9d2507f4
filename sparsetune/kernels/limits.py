"""Shapes the kernels accept, and the device's size they plan launches by; importable without triton
(the CPU cost model reads them)."""

import functools

import torch

TOPK_MAX_WIDTH = 16384 + 1024  # widest row the radix select holds in registers that ran on a GPU (a 32K context at 2-token units: ~16.4K); wider rows: torch's top-k
DEFAULT_NUM_SMS = 132  # an H100's / H200's streaming multiprocessors: what launches plan for off a GPU


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors a launch on `device` spreads over (`DEFAULT_NUM_SMS` off a GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS
