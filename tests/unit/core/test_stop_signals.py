"""One stop-signal helper for every process: the first signal stops, later ones hurry."""

from __future__ import annotations

import os
import signal

import pytest

from asyncrl.core.stop_signals import Interrupted, StopSignals, raise_interrupted


def test_the_first_signal_is_the_stop_and_later_ones_hurry_it() -> None:
    heard: list[int] = []
    with StopSignals((signal.SIGUSR1, signal.SIGUSR2), on_stop=heard.append) as signals:
        assert not signals() and not signals.hurry()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert signals() and signals.signum == signal.SIGUSR2 and not signals.hurry()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.signum == signal.SIGUSR2 and signals.hurry()
        with pytest.raises(Interrupted, match="SIGUSR2") as raised:
            signals.check()
        assert raised.value.signum == signal.SIGUSR2
    assert heard == [signal.SIGUSR2]  # on_stop once, for the first


def test_a_signal_once_the_caller_began_its_stop_only_hurries() -> None:
    with StopSignals((signal.SIGUSR1,)) as signals:
        signals.stopping = True
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.hurry() and signals.signum is None


def test_the_previous_handlers_come_back() -> None:
    def before(*_: object) -> None:
        pass

    previous = signal.signal(signal.SIGUSR1, before)
    try:
        with StopSignals((signal.SIGUSR1,)):
            assert signal.getsignal(signal.SIGUSR1) is not before
        assert signal.getsignal(signal.SIGUSR1) is before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_raise_interrupted_ends_the_main_loop_at_the_first_signal() -> None:
    with StopSignals((signal.SIGUSR1,), on_stop=raise_interrupted) as signals:
        with pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGUSR1)
            signal.pause()  # not reached: the handler raises first
        assert raised.value.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)  # while stopping: no second raise
        assert signals.hurry()
