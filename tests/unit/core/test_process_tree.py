"""Ending the processes a run started, and only those."""

from __future__ import annotations

import subprocess
import sys

import psutil

from asyncrl.generation.process_tree import end_survivors


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_survivors_of_the_grace_are_killed_and_counted_the_others_left_to_exit():
    quitter = spawn("pass")
    stubborn = spawn(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    )
    try:
        processes = [psutil.Process(quitter.pid), psutil.Process(stubborn.pid)]
        assert end_survivors(processes, grace_s=1.0) == 1
        assert not any(process.is_running() for process in processes)
    finally:
        stubborn.kill()
        stubborn.wait()


def test_a_process_already_gone_is_not_counted():
    child = spawn("pass")
    process = psutil.Process(child.pid)
    child.wait()
    assert end_survivors([process], grace_s=0.1) == 0
