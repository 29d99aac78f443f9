"""The python tool's sandbox: what a call costs, and how long ending a call's whole tree takes.

::

    .venv/bin/python benchmarks/sandbox_calls.py                 # this checkout
    .venv/bin/python benchmarks/sandbox_calls.py --cgroup off    # without a cgroup per call

- per call: the median wall time of ``Sandbox().run("print(1)")`` over ``--calls``
  calls (after one warm-up call), from ``Sandbox.run`` entered to returned, and,
  where a cgroup v1 ``cpuacct`` hierarchy is writable (root on a hybrid host),
  the CPU time of all the call's processes (bwrap, PID 1, the code) from a
  ``cpuacct`` cgroup this script moves itself into: unlike wall time it does
  not grow with the machine's load;
- time to kill: a call forks as many processes as ``max_processes`` allows, each
  double-forked, in a session of its own, without a parent-death signal and
  ignoring ``SIGTERM``/``SIGHUP``/``SIGINT``, then sleeps past its time limit.
  Measured from the first stop of the call (its time limit) until every process
  of it is gone and its cgroup removed (``CallTree.stop`` to ``CallTree.close``).

To compare against another checkout, run the same script there with
``PYTHONPATH`` pointing at it (the kill measure needs this checkout's
``asyncrl.generation.envs.sandbox.launch``), alternating the two, on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

from asyncrl.generation.envs.sandbox import Sandbox

TREE = r"""
import ctypes, os, signal, time
prctl = ctypes.CDLL(None).prctl
started = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.setsid()
        prctl(1, 0, 0, 0, 0)  # no parent-death signal
        for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(number, signal.SIG_IGN)
        if os.fork():
            os._exit(0)
        while True:
            time.sleep(1)
    started += 1
print(started, flush=True)
time.sleep(600)
"""


CPUACCT = "/sys/fs/cgroup/cpuacct"


@contextlib.contextmanager
def cpu_meter():
    """A function returning the CPU seconds used by this process and its children
    so far (None without a writable cpuacct hierarchy)."""
    path = os.path.join(CPUACCT, f"asyncrl-sandbox-bench-{os.getpid()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        yield lambda: None
        return
    try:
        yield lambda: int(Path(path, "cpuacct.usage").read_text()) / 1e9
    finally:
        with open(os.path.join(CPUACCT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(path)


def per_call(sandbox: Sandbox, calls: int, cpu_used) -> tuple[list[float], list[float]]:
    sandbox.run("print(1)")
    times, cpu = [], []
    for _ in range(calls):
        cpu_before, start = cpu_used(), time.perf_counter()
        result = sandbox.run("print(1)")
        times.append(time.perf_counter() - start)
        if cpu_before is not None:
            cpu.append(cpu_used() - cpu_before)
        assert result.stdout == "1\n", result
    return times, cpu


def time_to_kill(sandbox: Sandbox, calls: int) -> tuple[list[float], str]:
    from asyncrl.generation.envs.sandbox import launch

    first_stop: dict[int, float] = {}
    timings: list[float] = []
    stop, close = launch.CallTree.stop, launch.CallTree.close

    def timed_stop(tree: launch.CallTree) -> None:
        first_stop.setdefault(id(tree), time.perf_counter())
        stop(tree)

    def timed_close(tree: launch.CallTree) -> tuple[str, ...]:
        notes = close(tree)
        timings.append(time.perf_counter() - first_stop.pop(id(tree)))
        return notes

    launch.CallTree.stop, launch.CallTree.close = timed_stop, timed_close
    try:
        for _ in range(calls):
            result = sandbox.run(TREE)
            assert result.timed_out, result
    finally:
        launch.CallTree.stop, launch.CallTree.close = stop, close
    return timings, result.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--cgroup", default="auto", choices=["auto", "required", "off"])
    parser.add_argument("--skip-kill", action="store_true", help="per-call time only")
    args = parser.parse_args()
    cgroup = {"cgroup": args.cgroup} if args.cgroup != "auto" else {}  # old checkouts: none
    sandbox = Sandbox(**cgroup)
    with cpu_meter() as cpu_used:
        times, cpu = per_call(sandbox, args.calls, cpu_used)
    layers = sandbox.run("pass").layers
    cpu_line = f", CPU median {statistics.median(cpu) * 1e3:.1f} ms" if cpu else ""
    print(
        f"per call: median {statistics.median(times) * 1e3:.1f} ms "
        f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}){cpu_line}, "
        f"{args.calls} calls; layers {', '.join(layers)}"
    )
    if not args.skip_kill:
        killer = Sandbox(timeout_s=1.5, memory_mb=256, **cgroup)
        timings, started = time_to_kill(killer, max(args.calls // 2, 1))
        print(
            f"time to kill a call's whole tree ({started} double-forked processes): "
            f"median {statistics.median(timings) * 1e3:.1f} ms, "
            f"max {max(timings) * 1e3:.1f} ms, {len(timings)} calls"
        )


if __name__ == "__main__":
    main()
