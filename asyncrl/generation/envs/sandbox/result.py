"""What a sandboxed call reports, and the error a launcher refuses to start on."""

from __future__ import annotations

from dataclasses import dataclass, field

INSTALL_HINT = (
    "install bubblewrap (`apt-get install bubblewrap`, or `bash scripts/setup.sh` as root) "
    "and make sure unprivileged user namespaces are enabled "
    "(`sysctl user.max_user_namespaces` > 0, `kernel.unprivileged_userns_clone=1` "
    "where it exists; Docker's default seccomp profile blocks them: run the container "
    "with a profile that allows them); or, for trusted code only, set "
    "`environment.python_isolation: none`"
)


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot be applied here. The message is one line
    saying what is wrong and how to fix it."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    """Exit status; negative: killed by that signal; None: the code never ran
    (``stderr`` says why)."""
    timed_out: bool
    truncated: bool
    """stdout or stderr went over ``max_output_bytes`` and was cut."""
    duration_s: float
    layers: tuple[str, ...] = ()
    """What was applied: with bubblewrap ``bubblewrap``, ``separate-user`` (bwrap
    ran as ``Sandbox.user``), the namespaces ``user``, ``pid``, ``net``,
    ``mount``, ``ipc``, ``uts``, ``cgroup``, then ``seccomp`` and ``rlimits``;
    with ``isolation="none"`` only ``rlimits``."""
    notes: tuple[str, ...] = field(default=())
    """Why the code did not run, or a layer could not be applied."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def not_run(reason: str) -> SandboxResult:
    """A result for code that was never run, ``stderr`` and ``notes`` saying why."""
    return SandboxResult(
        "", f"sandbox: the code was not run: {reason}\n", None, False, False, 0.0, (), (reason,)
    )
