"""Checks for a launcher: refuse to start a run whose sandbox cannot run code."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from asyncrl.generation.envs.sandbox.cgroup_detect import cgroup_support
from asyncrl.generation.envs.sandbox.result import SandboxUnavailable
from asyncrl.generation.envs.sandbox.runner import Sandbox

log = logging.getLogger("asyncrl.envs.sandbox")

_CHECKED: set[Sandbox] = set()
_CHECKED_LOCK = threading.Lock()


def check_isolation(sandbox: Sandbox | None = None) -> str:
    """Raise :class:`SandboxUnavailable` (one line: what is wrong, how to fix it)
    unless ``sandbox`` (default ``Sandbox()``) can run code with the isolation it
    is configured for: the static checks of :meth:`Sandbox.unavailable`, then
    ``print(1)`` run in it once. Nothing to check for ``isolation="none"``. A
    sandbox that passed is not probed again in this process. Returns (and logs)
    the line saying what limits a call: by a cgroup of its own (v2 or v1), or
    per process only."""
    sandbox = sandbox if sandbox is not None else Sandbox()
    if sandbox.isolation == "none":
        return "no isolation (isolation=none): per-process rlimits only"
    limits = limits_in_force(sandbox)
    with _CHECKED_LOCK:
        if sandbox in _CHECKED:
            return limits
    problem = sandbox.unavailable()
    if problem is not None:
        raise SandboxUnavailable(f"the python tool's sandbox cannot run: {problem}")
    probe = replace(
        sandbox, timeout_s=max(sandbox.timeout_s, 10.0), memory_mb=max(sandbox.memory_mb, 64)
    )
    result = probe.run("print(1)")
    if result.stdout != "1\n" or result.returncode != 0:
        why = " ".join(result.notes) or " ".join(
            (result.stderr.strip() or f"exit code {result.returncode}").split()
        )
        if result.timed_out:
            why = f"the probe print(1) timed out after {probe.timeout_s:g}s"
        raise SandboxUnavailable(f"the python tool's sandbox cannot run: {why}")
    with _CHECKED_LOCK:
        _CHECKED.add(sandbox)
    log.info("python sandbox: checked; %s", limits)
    return limits


def limits_in_force(sandbox: Sandbox) -> str:
    """One line: whether ``sandbox``'s calls are bounded as a whole (which cgroup
    version and controllers) or per process only, and why."""
    if sandbox.cgroup == "off":
        return "no whole-call limits (Sandbox.cgroup='off'): limits are per process only"
    return cgroup_support().describe()


def check_isolation_for(config: Any) -> None:
    """:func:`check_isolation` for the sandbox a run's config gives the built-in
    ``python`` tool (``Config.environment``, or an ``EnvironmentConfig``). Returns
    None without probing when no environment uses that tool or its isolation is
    ``none`` (the tool logs its warning when built); raises
    :class:`SandboxUnavailable` otherwise, when the probe fails."""
    from asyncrl.config.environment import EnvironmentConfig, python_tool_limits

    environment = config if isinstance(config, EnvironmentConfig) else config.environment
    if environment is None:
        return None
    limits = python_tool_limits(environment)  # the schema's; building the tool would import us
    if limits is None or limits["isolation"] == "none":
        return None
    check_isolation(Sandbox(**limits))
    return None
