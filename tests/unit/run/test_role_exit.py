"""A buffer or generator process that finished its work ends without finalizing the
interpreter (``asyncrl.run.roles.end_without_finalizing``): its exit handlers still run and
nothing it printed or logged is lost, but the objects the interpreter would free one by
one at finalization (a second of every stop, once torch is imported) are left to the
kernel."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import atexit, logging, sys
from asyncrl.run.roles import end_without_finalizing

class FreedAtFinalization:
    def __del__(self):
        print("finalized", flush=True)

KEPT = FreedAtFinalization()  # a module global: freed only when the interpreter finalizes
logging.basicConfig(level="INFO", format="%(message)s")
atexit.register(lambda: print("exit handler", end=""))
print("printed ", end="")   # no newline: still sitting in stdout's buffer
logging.getLogger("generator").info("logged")
end_without_finalizing()
print("after exit")
"""


def test_exit_runs_the_exit_handlers_keeps_output_and_skips_finalization():
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "printed exit handler"  # no "finalized", nothing after the exit
    assert "logged" in result.stderr
