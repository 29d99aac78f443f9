"""Faults injected into real `asyncrl launch` runs, for the fault table of docs/running.md.

Each scenario starts the real command on the quickstart config (shortened),
injects its faults from outside as an operator, the OS or a user's code would,
and returns a :class:`Case` per fault: the exit status, the lines that name the
fault, what was lost, what resume did, which processes were left, and how long
it took. ``tests/integration/test_faults.py`` asserts on the cases;
``benchmarks/fault_table.py`` runs the same scenarios and writes the table.

The injections are real: ``kill -9`` and ``SIGSTOP``; a small tmpfs kept full to
the last page (disk full); a read-only mount (an unwritable run directory, an
aim repository that turns read-only mid-run); a reward function file that
hangs, exits or prints 64 MiB. Only the slow chunk is planted: a
``sitecustomize`` on ``PYTHONPATH`` makes one engine call of one generator
sleep. The mounts need root (CI and this machine run as root); without it
:class:`MountUnavailable` says why and the test skips.

By job: :mod:`.launch` (the run and its processes), :mod:`.ledger` (the prompts'
accounting), :mod:`.cases` (what a fault did), :mod:`.mounts` (disks), :mod:`.planted`
(faults in a user's code), :mod:`.contained` and :mod:`.stopping` (the scenarios).
What the tests and the table use is importable from here.
"""

from __future__ import annotations

from tests.helpers.faults.cases import Case
from tests.helpers.faults.contained import SLOW_CHUNK_S, contained_faults, killed_generator
from tests.helpers.faults.launch import STALL_S
from tests.helpers.faults.ledger import Ledger, final_ledger
from tests.helpers.faults.mounts import MountUnavailable
from tests.helpers.faults.planted import keep_base_env
from tests.helpers.faults.stopping import EVERY, killed_buffer, stopping_faults, unwritable_run_dir

__all__ = [
    "EVERY",
    "SLOW_CHUNK_S",
    "STALL_S",
    "Case",
    "Ledger",
    "MountUnavailable",
    "contained_faults",
    "final_ledger",
    "keep_base_env",
    "killed_buffer",
    "killed_generator",
    "stopping_faults",
    "unwritable_run_dir",
]
