"""Which cgroups this machine gives the sandbox's calls: :func:`cgroup_support`.

Decided once per process:

- ``cgroup-v2``: a cgroup v2 directory where this process may create children
  with the ``memory`` and ``pids`` controllers enabled: ``ASYNCRL_SANDBOX_CGROUP``
  when set, else this process's own cgroup when its ``cgroup.subtree_control``
  has them or they can be enabled there (docs/security.md says how to delegate
  a subtree with systemd); a call is killed with ``cgroup.kill``;
- ``cgroup-v1``: the ``memory`` and ``pids`` hierarchies (``cpu`` and
  ``freezer`` where mounted), in children of this process's own cgroups (a
  hybrid host where the process is root); a call is killed frozen;
- ``none``: no writable cgroup. Limits are then per process only, which is
  logged as a warning once and said by the preflight
  (:func:`~asyncrl.generation.envs.sandbox.checks.check_isolation`). A directory named by
  ``ASYNCRL_SANDBOX_CGROUP`` that cannot be used is not replaced: the sandbox
  then runs no code.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass

from asyncrl.generation.envs.sandbox.cgroups import (
    CallGroup,
    CallLimits,
    CgroupV1Call,
    CgroupV2Call,
    cgroup_name,
    read,
    write,
)

log = logging.getLogger("asyncrl.envs.sandbox")

CGROUP_ENV = "ASYNCRL_SANDBOX_CGROUP"
"""A cgroup v2 directory for the calls' cgroups, overriding the detection."""

REQUIRED = ("memory", "pids")
"""Controllers without which there is no whole-call limit."""
OPTIONAL_V1 = ("cpu", "freezer")


@dataclass(frozen=True)
class CgroupSupport:
    """The cgroups this process can give its calls (:func:`cgroup_support`)."""

    mode: str
    """``cgroup-v2``, ``cgroup-v1`` or ``none``."""
    parents: tuple[tuple[str, str], ...] = ()
    """``(controller, directory)`` the calls' cgroups are made in (v2: one, ``""``)."""
    reason: str = ""
    """Why there is no cgroup (mode ``none``)."""

    def describe(self) -> str:
        """One line for the preflight and the log: which limits hold a call."""
        if self.mode == "cgroup-v2":
            return (
                f"whole-call limits by cgroup v2 under {self.parents[0][1]} "
                f"({', '.join(self._controllers())})"
            )
        if self.mode == "cgroup-v1":
            return (
                f"whole-call limits by cgroup v1 ({', '.join(self._controllers())}) "
                f"under {dict(self.parents)['memory']}"
            )
        return (
            f"no whole-call limits ({self.reason}): memory, processes and CPU are limited "
            f"per process only, so a call of N processes may hold N x memory_mb"
        )

    def _controllers(self) -> list[str]:
        if self.mode == "cgroup-v2":
            return [c for c in (*REQUIRED, "cpu") if c in _v2_enabled(self.parents[0][1])]
        return [controller for controller, _ in self.parents]

    def create(self, limits: CallLimits) -> CallGroup:
        """A new cgroup for one call, its limits written; raises OSError."""
        if self.mode == "cgroup-v2":
            parent = self.parents[0][1]
            return CgroupV2Call(parent, limits, _v2_enabled(parent))
        if self.mode == "cgroup-v1":
            return CgroupV1Call(dict(self.parents), limits)
        return CallGroup()


def _v2_enabled(path: str) -> list[str]:
    try:
        return read(os.path.join(path, "cgroup.subtree_control")).split()
    except OSError:
        return []


def _unescape(path: str) -> str:
    """A path from /proc/self/mountinfo (spaces and such are octal escapes)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), path)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, mount point, root, super options)`` of the cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, tail = line.partition(" - ")
            parts, extra = fields.split(), tail.split()
            if len(parts) >= 5 and len(extra) >= 3 and extra[0] in ("cgroup", "cgroup2"):
                found.append(
                    (extra[0], _unescape(parts[4]), _unescape(parts[3]), set(extra[2].split(",")))
                )
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``""`` for v2, else the controllers
    of the hierarchy joined by commas, as in /proc/self/cgroup."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            own[controllers] = path
    return own


def _inside(mount: str, root: str, path: str) -> str | None:
    """Where the cgroup ``path`` is under a mount of hierarchy ``root``."""
    if root != "/" and not (path == root or path.startswith(root + "/")):
        return None
    relative = path[len(root) :] if root != "/" else path
    return os.path.normpath(os.path.join(mount, relative.lstrip("/")))


def _can_make_children(path: str) -> str | None:
    """None when a child cgroup can be made (and removed) in ``path``, else why not."""
    probe = os.path.join(path, cgroup_name())
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup in {path}: {exc.strerror}"
    return None


def _detect_v2(mounts, own) -> CgroupSupport | str:
    override = os.environ.get(CGROUP_ENV)
    v2 = [(point, root) for kind, point, root, _ in mounts if kind == "cgroup2"]
    if override:
        parent = override
    elif not v2 or "" not in own:
        return "no cgroup v2 hierarchy"
    else:
        parent = _inside(v2[0][0], v2[0][1], own[""])
        if parent is None:
            return "this process's cgroup v2 is outside the mounted hierarchy"
    enabled = _v2_enabled(parent)
    if not set(REQUIRED) <= set(enabled):
        try:
            available = read(os.path.join(parent, "cgroup.controllers")).split()
        except OSError as exc:
            return f"cgroup v2 {parent}: {exc.strerror}"
        missing = [c for c in REQUIRED if c not in available]
        if missing:
            return f"cgroup v2 {parent} lacks the {'/'.join(missing)} controller(s)"
        wanted = [c for c in (*REQUIRED, "cpu") if c in available and c not in enabled]
        try:
            write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{c}" for c in wanted))
        except OSError as exc:
            control = os.path.join(parent, "cgroup.subtree_control")
            return f"cannot enable {' '.join(wanted)} in {control}: {exc.strerror}"
    problem = _can_make_children(parent)
    return problem or CgroupSupport("cgroup-v2", (("", parent),))


def _detect_v1(mounts, own) -> CgroupSupport | str:
    parents: dict[str, str] = {}
    for kind, point, root, options in mounts:
        if kind != "cgroup":
            continue
        for controllers, path in own.items():
            if controllers and set(controllers.split(",")) <= options:
                for controller in (*REQUIRED, *OPTIONAL_V1):
                    if controller in controllers.split(",") and controller not in parents:
                        where = _inside(point, root, path)
                        if where is not None:
                            parents[controller] = where
    missing = [c for c in REQUIRED if c not in parents]
    if missing:
        return f"no cgroup v1 {'/'.join(missing)} hierarchy"
    for controller in list(parents):
        problem = _can_make_children(parents[controller])
        if problem and controller in REQUIRED:
            return problem
        if problem:
            del parents[controller]
    order = [c for c in (*REQUIRED, *OPTIONAL_V1) if c in parents]
    return CgroupSupport("cgroup-v1", tuple((c, parents[c]) for c in order))


_SUPPORT: CgroupSupport | None = None
_SUPPORT_LOCK = threading.Lock()


def cgroup_support() -> CgroupSupport:
    """The cgroups of this machine for the sandbox's calls, found on the first call
    and kept; mode ``none`` is logged once as a warning."""
    global _SUPPORT
    with _SUPPORT_LOCK:
        if _SUPPORT is None:
            _SUPPORT = _detect()
            if _SUPPORT.mode == "none":
                log.warning("python sandbox: %s; see docs/security.md", _SUPPORT.describe())
            else:
                log.info("python sandbox: %s", _SUPPORT.describe())
        return _SUPPORT


def _detect() -> CgroupSupport:
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as exc:
        return CgroupSupport("none", reason=f"cannot read this process's cgroups: {exc}")
    reasons = []
    for detect in (_detect_v2, _detect_v1):
        found = detect(mounts, own)
        if isinstance(found, CgroupSupport):
            return found
        reasons.append(found)
        if detect is _detect_v2 and os.environ.get(CGROUP_ENV):
            break  # a named directory that does not work is not silently replaced
    return CgroupSupport("none", reason="; ".join(reasons))
