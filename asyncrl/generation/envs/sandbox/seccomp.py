"""The sandbox's seccomp filter: system calls a program here never needs, refused.

Built once per process with libseccomp through ``pyseccomp`` and handed to
``bwrap --seccomp`` as a BPF program. It refuses with ``EPERM`` the calls in
:data:`DENIED_SYSCALLS`, ``clone`` with any namespace flag, sockets of any
family but ``AF_UNIX`` and the terminal-injecting ``ioctl``s; ``clone3`` gets
``ENOSYS`` so that libc falls back to ``clone``, whose flags the filter can
read. When it cannot be built the sandbox does not run code
(:class:`~asyncrl.generation.envs.sandbox.result.SandboxUnavailable`).
"""

from __future__ import annotations

import contextlib
import errno
import sys
import tempfile
import threading

from asyncrl.generation.envs.sandbox.result import SandboxUnavailable

DENIED_SYSCALLS: tuple[str, ...] = (
    # other processes' memory
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounts and namespaces (bwrap has set them up already)
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns",
    # the kernel's larger attack surfaces
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key",
    # the machine
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname",
    "setdomainname", "iopl", "ioperm", "vhangup", "uselib", "nfsservctl",
    # files by handle, around the mount namespace
    "open_by_handle_at", "name_to_handle_at",
    "personality", "lookup_dcookie",
)  # fmt: skip
"""Refused with ``EPERM`` by the sandbox's seccomp filter (those this
architecture lacks are skipped)."""

CLONE_NAMESPACE_FLAGS = (
    0x00000080,  # CLONE_NEWTIME
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)
AF_UNIX = 1
TIOCSTI, TIOCLINUX = 0x5412, 0x541C

_SECCOMP_LOCK = threading.Lock()
_SECCOMP: bytes | SandboxUnavailable | None = None


def seccomp_program() -> bytes:
    """The sandbox's seccomp filter as a BPF program for ``bwrap --seccomp``;
    built on the first call and kept. Raises :class:`SandboxUnavailable` when it
    cannot be built."""
    global _SECCOMP
    with _SECCOMP_LOCK:
        if _SECCOMP is None:
            try:
                _SECCOMP = _build_seccomp_program()
            except SandboxUnavailable as exc:
                _SECCOMP = exc
        if isinstance(_SECCOMP, SandboxUnavailable):
            raise SandboxUnavailable(str(_SECCOMP))
        return _SECCOMP


def _build_seccomp_program() -> bytes:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the sandbox needs Linux (seccomp, namespaces): {sys.platform}")
    try:
        import pyseccomp as seccomp
    except ImportError:
        raise SandboxUnavailable(
            "seccomp: the pyseccomp package is missing: pip install 'pyseccomp>=0.1.2'"
        ) from None
    except (RuntimeError, OSError) as exc:  # pyseccomp raises RuntimeError without libseccomp
        raise SandboxUnavailable(
            f"seccomp: libseccomp cannot be loaded ({exc}): apt-get install libseccomp2"
        ) from None
    deny = seccomp.ERRNO(errno.EPERM)
    try:
        program = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in DENIED_SYSCALLS:
            with contextlib.suppress(OSError):  # not a system call on this architecture
                program.add_rule(deny, name)
        for flag in CLONE_NAMESPACE_FLAGS:
            program.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc
        # fall back to clone, whose flags the rules above see.
        with contextlib.suppress(OSError):
            program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        for call in ("socket", "socketpair"):
            program.add_rule(deny, call, seccomp.Arg(0, seccomp.NE, AF_UNIX))
        for request in (TIOCSTI, TIOCLINUX):
            program.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
        with tempfile.TemporaryFile() as f:
            program.export_bpf(f)
            f.seek(0)
            return f.read()
    except OSError as exc:
        raise SandboxUnavailable(f"seccomp: could not build the filter: {exc}") from None
