"""The timing harness (`sparsetune.perf.timing`) against the host clock read directly."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from sparsetune.perf.timing import percentile, time_call, time_calls

NAP = 0.02  # seconds each timed call sleeps


def nap() -> None:
    time.sleep(NAP)


def test_time_call_matches_the_host_clock():
    t0 = time.perf_counter()
    got = time_call(nap, "cpu")
    outer = time.perf_counter() - t0
    assert NAP <= got <= outer  # at least the sleep, at most what a clock read around the harness saw


def test_time_calls_counts_warmups_and_repeats():
    calls = []
    times = time_calls(lambda: calls.append(1), "cpu", repeats=5, warmup=3)
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_median_of_sleeps_is_near_the_reference():
    ref = []
    for _ in range(5):  # the same calls timed by hand
        t0 = time.perf_counter()
        nap()
        ref.append(time.perf_counter() - t0)
    med = statistics.median(time_calls(nap, "cpu", repeats=5, warmup=1))
    # Generous: a shared machine may stall either side; only gross errors (units, missing calls) fail.
    assert NAP <= med < 5 * statistics.median(ref) + 0.05


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 0.0) == 1.0 and percentile(values, 0.5) == 3.0 and percentile(values, 1.0) == 5.0
    assert percentile(values, 0.95) == 5.0 and percentile([7.0], 0.95) == 7.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_events_time_gpu_work():
    a = torch.randn(2048, 2048, device="cuda")
    times = time_calls(lambda: a @ a, "cuda", repeats=3, warmup=1, events=True)
    assert len(times) == 3 and all(t > 0 for t in times)
