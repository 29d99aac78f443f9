"""Hosts the sandbox must also hold on, for the sandbox tests: a seccomp filter that denies
namespaces (prepended to a child's code)."""

from __future__ import annotations

DENY_NAMESPACES = """
import errno, pyseccomp as seccomp
deny = seccomp.ERRNO(errno.EPERM)
rules = seccomp.SyscallFilter(seccomp.ALLOW)
rules.add_rule(deny, "unshare")
rules.add_rule(deny, "setns")
for flag in (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000):
    rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
rules.load()
"""
"""Makes this process a host where namespaces cannot be created (Docker's default
seccomp profile, a kernel without unprivileged user namespaces)."""
