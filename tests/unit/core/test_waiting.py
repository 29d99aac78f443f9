"""One wait that a stop can end, in slices: ready, stopped (after any grace) or timed out."""

from __future__ import annotations

from asyncrl.core.waiting import Waited, wait_with_stop


class Clock:
    """A clock that ``ready`` moves by the slice it was given (nothing sleeps)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slices: list[float] = []

    def __call__(self) -> float:
        return self.now

    def ready_at(self, at: float):
        def ready(wait_s: float) -> bool:
            self.slices.append(wait_s)
            self.now += wait_s
            return self.now >= at

        return ready


def test_ready_within_the_timeout() -> None:
    clock = Clock()
    assert wait_with_stop(clock.ready_at(0.5), 10.0, slice_s=0.2, clock=clock) is Waited.READY
    assert clock.slices == [0.2, 0.2, 0.2]


def test_the_last_slice_is_cut_to_the_deadline_and_it_times_out() -> None:
    clock = Clock()
    waited = wait_with_stop(clock.ready_at(99), 0.5, slice_s=0.2, clock=clock)
    assert waited is Waited.TIMED_OUT
    assert [round(s, 6) for s in clock.slices] == [0.2, 0.2, 0.1]


def test_a_stop_ends_the_wait_after_the_slice_in_which_it_came() -> None:
    clock = Clock()
    waited = wait_with_stop(
        clock.ready_at(99), 60.0, stop=lambda: clock.now >= 1.0, slice_s=0.2, clock=clock
    )
    assert waited is Waited.STOPPED and round(clock.now, 6) == 1.0


def test_a_stop_with_grace_waits_that_much_longer_for_the_answer() -> None:
    stop_at_1 = {"stop": lambda: True}
    clock = Clock()
    waited = wait_with_stop(
        clock.ready_at(2.5), 60.0, slice_s=0.5, grace_s=5.0, clock=clock, **stop_at_1
    )
    assert waited is Waited.READY  # the answer came within the grace
    clock = Clock()
    waited = wait_with_stop(
        clock.ready_at(99), 60.0, slice_s=0.5, grace_s=2.0, clock=clock, **stop_at_1
    )
    assert waited is Waited.STOPPED and round(clock.now, 6) == 2.5  # the first slice, then 2 s


def test_no_time_left_still_looks_once() -> None:
    clock = Clock()
    assert wait_with_stop(clock.ready_at(0.0), -1.0, clock=clock) is Waited.READY
    assert clock.slices == [0.0]
