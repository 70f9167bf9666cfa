"""A rise in a function's AER counters keeps it Unhealthy for a whole health interval, however
many scans come in between (host/core/health.py AerTracker)."""

from __future__ import annotations

from host.core.health import AerCounts, AerTracker

A = "0000:19:00.0"


def test_a_rise_holds_for_the_interval_then_heals_at_the_next_clean_check():
    now = [0.0]
    tracker = AerTracker(clock=lambda: now[0])
    assert tracker.problem("r", A, AerCounts(0, 2), 1.0) == ""  # boot-time errors: fine
    now[0] = 1.0
    rise = tracker.problem("r", A, AerCounts(0, 3), 1.0)
    assert rise == f"PCIe AER errors rising on {A} (non-fatal 2->3)"
    for at in (1.01, 1.5, 1.99):  # other scans (events, the safety rescan) within the hold
        now[0] = at
        assert tracker.problem("r", A, AerCounts(0, 3), 1.0) == rise
    now[0] = 2.0
    assert tracker.problem("r", A, AerCounts(0, 3), 1.0) == ""


def test_a_new_rise_restarts_the_hold_and_without_one_the_next_check_heals():
    now = [0.0]
    tracker = AerTracker(clock=lambda: now[0])
    tracker.problem("r", A, AerCounts(0, 0), 1.0)
    now[0] = 1.0
    assert tracker.problem("r", A, AerCounts(1, 0), 1.0)
    now[0] = 1.8
    second = tracker.problem("r", A, AerCounts(1, 1), 1.0)
    assert "non-fatal 0->1" in second
    now[0] = 2.5
    assert tracker.problem("r", A, AerCounts(1, 1), 1.0) == second
    now[0] = 2.9
    assert tracker.problem("r", A, AerCounts(1, 1), 1.0) == ""
    # No hold: the next check without new errors heals at once.
    now[0] = 3.0
    assert tracker.problem("r", A, AerCounts(2, 1))
    assert tracker.problem("r", A, AerCounts(2, 1)) == ""


def test_a_function_gone_or_without_statistics_drops_its_hold():
    now = [0.0]
    tracker = AerTracker(clock=lambda: now[0])
    tracker.problem("r", A, AerCounts(0, 0), 5.0)
    assert tracker.problem("r", A, AerCounts(0, 1), 5.0)
    tracker.retain("r", ())
    assert tracker.tracked() == set()
    assert tracker.problem("r", A, AerCounts(0, 1), 5.0) == ""  # a first reading again
    assert tracker.problem("r", A, AerCounts(0, 2), 5.0)
    assert tracker.problem("r", A, None, 5.0) == ""
    assert tracker.problem("r", A, AerCounts(0, 2), 5.0) == ""
