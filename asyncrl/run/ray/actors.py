"""What runs inside each Ray actor of a run: one role, exactly as the local launcher runs it.

:class:`RoleActor` is a plain class; :mod:`asyncrl.run.ray.placement` wraps it with
``ray.remote`` and the resources of the role it will hold. An actor first
reports where it landed (:meth:`RoleActor.start`), then runs its role through
:func:`asyncrl.run.roles.main` (:meth:`RoleActor.run`), the same entry point as
``python -m asyncrl.run.roles``: the role gets the driver's config in the
environment :meth:`RoleActor.run` is handed (``ASYNCRL_CONFIG``, never
``RUN_DIR/config.yaml``, which a restarted generator would otherwise read
back) and its output goes to ``RUN_DIR/logs/NAME.log``. Nothing here
re-implements a role.

Ray runs a plain actor's methods on its process's main thread, so the roles'
own SIGTERM handlers work: :func:`terminate`, pinned to the actor's node,
stops a role the way the local launcher does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from asyncrl.core.stop_signals import StopSignals

FAILED_EXIT_S = 10.0
"""A role that raised ends its actor's process this long after the error. The driver
learns of a failure from the task's reply; when that reply is lost (the actor's host
was cut off from the driver while its role failed, and the connection did not survive
the cut), the actor's death, which Ray's node manager reports once the host is back,
is what tells it, so the replica is still replaced."""


class RoleActor:
    """Holds one role (buffer, a learner rank or a generator replica) of a run."""

    def start(self, run_dir: str, name: str, cwd: str) -> dict[str, str | int]:
        """Send this process's output to ``RUN_DIR/logs/NAME.log``; say where it runs,
        there too (which process to look at, or to kill when testing a restart).

        Works in the driver's directory when this node has it (so relative paths
        in the config mean the same as under the local launcher).
        """
        log_path = Path(run_dir) / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("a") as log:
            for fd in (1, 2):  # the role's logging, prints and child processes
                os.dup2(log.fileno(), fd)
        if Path(cwd).is_dir():
            os.chdir(cwd)
        import ray

        info = {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }
        print(
            f"asyncrl: ray actor {name}: pid {info['pid']} on node {info['ip']} "
            f"({info['node_id'][:6]})",
            file=sys.stderr,
            flush=True,
        )
        return info

    def free_ports(self, host: str, count: int) -> list[int]:
        """``count`` distinct ports free on this node's ``host`` right now."""
        with contextlib.ExitStack() as stack:
            probes = [stack.enter_context(socket.socket()) for _ in range(count)]
            for probe in probes:
                probe.bind((host, 0))
            return [probe.getsockname()[1] for probe in probes]

    def run(self, argv: list[str], env: dict[str, str], credentials: str | None = None) -> None:
        """``python -m asyncrl.run.roles ARGV`` in this process, with ``env`` added and
        holding ``credentials`` (its role's, as JSON: never an environment variable).

        A SIGTERM the role does not handle itself ends it like an exception
        (its cleanup runs) and counts as a clean stop, not as a dead worker. A
        role's error is written to its log, as it would be by a process.
        """
        os.environ.update(env)
        if credentials is not None:
            from asyncrl.core.credentials import Credentials, hold

            hold(Credentials.from_json(credentials))
        with StopSignals((signal.SIGTERM,), on_stop=_raise_stopped):
            from asyncrl.run.roles import main

            try:
                main(argv)
            except Stopped:
                print(f"asyncrl: {argv[0]} stopped by SIGTERM", file=sys.stderr, flush=True)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                exit_later(FAILED_EXIT_S)
                raise


class Stopped(BaseException):
    """Raised in a role by SIGTERM when the role has no handler of its own."""


def _raise_stopped(signum: int) -> None:
    raise Stopped


def exit_later(delay_s: float) -> None:
    """End this process ``delay_s`` from now, whatever it is doing then (a daemon timer:
    the role's own cleanup has run by the time its error reaches here)."""
    timer = threading.Timer(delay_s, os._exit, args=(1,))
    timer.daemon = True
    timer.start()


def terminate(pids: list[int]) -> None:
    """SIGTERM each of ``pids`` (processes on the node this runs on) that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
