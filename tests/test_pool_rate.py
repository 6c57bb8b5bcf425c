"""dispatcher.poolrate: what one turn of a replica serves (pure; the clock is passed)."""

from __future__ import annotations

import math

import pytest

from gpu_slicer.dispatcher.poolrate import MIN_RESULTS, ServiceRate, pool_rate, turn_capacity


def test_the_rate_counts_only_time_with_sends_in_flight() -> None:
    r = ServiceRate()
    r.step(0.0, 0, 0)
    r.step(5.0, 0, 0)  # a load: nothing in flight, nothing finished: not busy
    r.step(6.0, 8, 0)  # sends went out at 5.0 and still run: busy from 5 to 6
    r.step(7.0, 8, 8)
    r.step(8.0, 0, 16)  # the last ended in the span
    r.step(20.0, 0, 16)  # idle until the turn's end
    r.turn_ended(20.0, 16)
    assert r.per_s == pytest.approx(16 / 3)


def test_a_turn_of_few_results_measures_nothing_and_results_after_the_last_step_count() -> None:
    r = ServiceRate()
    r.step(0.0, 0, 0)
    r.step(1.0, 1, MIN_RESULTS - 1)
    r.turn_ended(1.0, MIN_RESULTS - 1)
    assert r.per_s is None  # their latency, not what the replica can serve
    r.step(10.0, 0, MIN_RESULTS - 1)
    r.step(12.0, 4, MIN_RESULTS + 3)
    # Stored in the grace, as the sends in flight ended: counted with the 2 s they took
    # (before: without them, 8 results in 2 s instead of 8 in 4).
    r.turn_ended(14.0, MIN_RESULTS + 7)
    assert r.per_s == pytest.approx(8 / 4)


def test_the_estimate_leans_toward_the_last_turns() -> None:
    r = ServiceRate()
    for rate in (10, 20):
        r.step(0.0, 0, 0)
        r.step(1.0, 0, rate)
        r.turn_ended(1.0, rate)
    assert r.per_s == pytest.approx(15.0)
    r.turn_ended(5.0, 99)  # a turn with no step: nothing measured, the estimate stays
    assert r.per_s == pytest.approx(15.0)


def test_a_counter_that_goes_back_measures_nothing_negative() -> None:
    r = ServiceRate()
    r.step(0.0, 2, 100)
    r.step(1.0, 2, 50)  # another store (a restart): never a negative count
    r.turn_ended(2.0, 40)
    assert r.per_s is None


@pytest.mark.parametrize(
    ("reported", "want"),
    [
        ([], None),
        ([None, "fast", True, -1, 0, math.nan, math.inf], None),
        ([10.0], 10.0),
        ([10, 30.0, 1000.0], 30.0),
        ([10.0, 20.0], 15.0),
    ],
)
def test_the_pools_rate_is_the_median_of_what_others_report(
    reported: list[object], want: float | None
) -> None:
    assert pool_rate(reported) == want


@pytest.mark.parametrize(
    ("slots", "rate", "seconds", "want"),
    [
        (8, None, 30.0, 8),  # nothing measured: the slots, as before
        (8, 0.1, 30.0, 8),  # a slow replica still covers its slots
        (8, 40.0, 5.0, 200),
        (8, 6.7, 5.0, 33),
        (8, 1e300, 30.0, 10**9),
    ],
)
def test_turn_capacity(slots: int, rate: float | None, seconds: float, want: int) -> None:
    assert turn_capacity(slots, rate, seconds) == want
