"""A learner process ends without finalizing the interpreter, its output flushed.

Finalization is where gloo's worker threads could abort the process (see
``asyncrl.learner.distributed.exit_without_finalizing``), so the exit must skip
it, yet nothing logged or printed before may be lost.
"""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, logging, sys
from asyncrl.learner.distributed import exit_without_finalizing

logging.basicConfig(level="INFO", format="%(message)s")
atexit.register(lambda: print("finalized", flush=True))
print("printed", end="")   # no newline: still sitting in stdout's buffer
logging.getLogger("learner").info("logged")
exit_without_finalizing(3)
print("after exit")
"""


def test_exit_skips_finalization_keeps_output_and_status():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3
    assert result.stdout == "printed"  # flushed; no atexit handler, nothing after the exit
    assert "logged" in result.stderr
