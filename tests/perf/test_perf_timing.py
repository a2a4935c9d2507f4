"""`sparsetune.perf`'s shared pieces: the timing harness against the host clock read directly, and
the one fit check in each caller's words."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from sparsetune.errors import SparsetuneError
from sparsetune.engine.block_manager import BlockManager
from sparsetune.perf.admission import EVAL, PROFILE, check_fits, check_positions
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


@pytest.mark.gpu
def test_cuda_events_time_gpu_work():
    a = torch.randn(2048, 2048, device="cuda")
    times = time_calls(lambda: a @ a, "cuda", repeats=3, warmup=1, events=True)
    assert len(times) == 3 and all(t > 0 for t in times)


def engine(max_model_len: int = 1000, positions: int = 2048, blocks: int = 100, block_size: int = 16):
    """What the fit check reads of an `Engine`."""
    return SimpleNamespace(max_model_len=max_model_len, resolved=SimpleNamespace(name="tiny"),
                           model_config=SimpleNamespace(max_position_embeddings=positions),
                           config=SimpleNamespace(block_size=block_size),
                           block_manager=BlockManager(blocks, block_size))  # the engine's own block rule


def refusal(*args) -> str:
    with pytest.raises(SparsetuneError) as e:
        check_fits(*args)
    return str(e.value)


def test_fit_check_refuses_in_evals_words():
    """Byte for byte the messages of eval's former `speed.check_fits` (tests pin their fixes)."""
    assert refusal(engine(), 1, 990, 20) == ("--context plus generation is 1010 tokens but the engine holds 1000 "
                                             "per request; lower --context or --max-new-tokens")
    assert refusal(engine(positions=1000), 1, 990, 20).startswith("--context plus generation is 1010 tokens")
    assert refusal(engine(blocks=100), 3, 600, 8) == ("3 requests of 608 tokens need 114 KV blocks but the pool "
                                                      "has 100; lower --batch or raise --kv-memory")


def test_fit_check_refuses_in_the_profilers_words():
    assert refusal(engine(positions=1024, max_model_len=1024), 1, 1010, 20, PROFILE) == (
        "--context 1010 is too long for tiny: it holds 1024 positions and the profile decodes 20 more tokens; "
        "use --context 1004 or less")
    assert refusal(engine(), 1, 990, 20, PROFILE) == (
        "--context 990 plus 20 decode tokens exceeds the engine's context (1000 tokens); "
        "raise --kv-memory or lower --context")
    assert refusal(engine(blocks=100), 3, 600, 8, PROFILE) == (
        "--batch 3 x --context 600 needs 114 KV blocks but the pool has 100; "
        "raise --kv-memory or lower --batch/--context")
    with pytest.raises(SparsetuneError, match="too long for tiny"):
        check_positions("tiny", 1024, 1010, 20, PROFILE)  # before an engine exists


def test_fit_check_boundary_is_the_engines():
    """A request of P + M tokens runs to its end when P + M <= max_model_len, in ceil((P + M) / 16) blocks."""
    check_fits(engine(max_model_len=1000, blocks=63), 1, 990, 10, EVAL)  # 1000 tokens, 63 blocks: fits
    check_fits(engine(blocks=126), 2, 990, 10, PROFILE)
    with pytest.raises(SparsetuneError, match="KV blocks"):
        check_fits(engine(blocks=125), 2, 990, 10)
