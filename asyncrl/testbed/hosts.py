"""Test hosts on one machine: a network namespace each, one cable each to a private switch.

A run that spans machines meets what a single host hides: real addresses
instead of loopback, listeners that must not bind everywhere, links with a
bandwidth and a latency, and links that fail. :class:`TestBed` gives each
host its own network stack (``ip netns``) with one interface ``eth0`` and an
address on a private /24, cabled to a Linux bridge that lives in a switch
namespace of its own, so the machine's own network is never touched. The
processes of a host are started through ``ip netns exec``; the bed ends them
by the pids its namespaces hold (nothing else lives there) and deletes the
namespaces however the caller ends.

A host's cable is a veth pair, or a :class:`~asyncrl.testbed.shaper.ShapedLink`
when the host is named in ``shaped``: this kernel family often lacks ``netem``,
so latency and loss come from a userspace relay, while a bandwidth limit is
the kernel's ``tbf`` on both ends of the cable and a cut is the switch port
going down.

Needs root, ``ip`` (iproute2) and ``tc``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from asyncrl.testbed.shaper import ShapedLink


PREFIX = "asyncrl-bed"
"""Namespace names start with this, then the creating process's pid: a bed whose creator
died is found (and swept) by that pid."""
SUBNET = "10.77.0"
"""The hosts' /24: private, and in namespaces of their own, so it clashes with nothing."""
SHM_ROOT = Path("/dev/shm")
"""Each host's own shared memory is a folder here, bind-mounted over its ``/dev/shm``."""
GRACE_S = 5.0
"""How long a host's processes get after SIGTERM before SIGKILL."""


class TestBedUnavailable(RuntimeError):
    """This machine cannot make test hosts (not root, no iproute2, namespaces forbidden)."""


def unavailable_reason(shaped: bool = False) -> str | None:
    """Why this machine cannot make test hosts (with ``shaped``: links with a latency and
    a loss too), or None when it can."""
    if shaped and not os.path.exists("/dev/net/tun"):
        return "shaped links need /dev/net/tun (TAP devices)"
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces and veth pairs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (Debian: apt-get install iproute2)"
    name = f"{PREFIX}-{os.getpid()}-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _tc(netns: str, *args: str) -> None:
    argv = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` in {netns} failed: {done.stderr.strip()}")


def namespace_pids(netns: str) -> list[int]:
    """The pids whose network namespace is ``netns``: on a test host, the ones we started."""
    done = _ip("netns", "pids", netns, check=False)
    return [int(pid) for pid in done.stdout.split()]


def end_processes(netns: str, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process of ``netns``, SIGKILL what is left after ``grace_s``; returns
    how many had to be killed."""
    for pid in namespace_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while namespace_pids(netns) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = namespace_pids(netns)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while namespace_pids(netns) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(left)


def sweep_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone (a test killed with
    SIGKILL cannot clean up); returns their names."""
    swept = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.*", name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        end_processes(name, grace_s=1.0)
        _ip("netns", "del", name, check=False)
        swept.append(name)
    for folder in SHM_ROOT.glob(f"{PREFIX}-*"):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-.*", folder.name)
        if match is not None and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return swept


@dataclass
class Host:
    """One test host: its namespace, its address and its cable's switch-side port."""

    name: str
    netns: str
    address: str
    port: str
    shm: Path
    """Mounted over ``/dev/shm`` for this host's processes: shared memory is per machine,
    so a path that hands weights over ``/dev/shm`` must not reach another host."""
    link: ShapedLink | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: in its namespace, over its own ``/dev/shm`` (the
        mount lives in the mount namespace ``ip netns exec`` makes for each command)."""
        own_shm = 'mount --bind "$0" /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "sh", "-c", own_shm, str(self.shm), *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this host (kept, so the bed ends it by pid)."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to completion (text output captured)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), **kwargs)

    def listeners(self) -> list[tuple[str, int, int | None]]:
        """The TCP sockets listening on this host: (address, port, pid or None)."""
        out = self.run(["ss", "-ltnpH"]).stdout
        found = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            address, _, port = parts[3].rpartition(":")
            pid = re.search(r"pid=(\d+)", line)
            found.append((address.strip("[]"), int(port), int(pid.group(1)) if pid else None))
        return found


class TestBed:
    """Hosts on a private switch; a context manager that tears everything down.

    ``names``: the hosts (the first gets ``.1``); ``shaped``: the hosts whose cable can
    take a latency and a loss (:meth:`shape`).
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        names: Sequence[str] = ("a", "b", "c"),
        *,
        shaped: Iterable[str] = (),
        mtu: int = 1500,
        subnet: str = SUBNET,
    ) -> None:
        shaped = set(shaped)
        unknown = shaped - set(names)
        if unknown:
            raise ValueError(f"shaped names hosts that are not in the bed: {sorted(unknown)}")
        if len(set(names)) != len(names) or not 1 <= len(names) <= 200:
            raise ValueError(f"host names must be 1 to 200 distinct names, got {list(names)}")
        for name in names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name) or name == "switch":
                raise ValueError(
                    f"host name {name!r}: a lowercase letter, then up to 15 letters or "
                    "digits, and not `switch` (the switch's namespace)"
                )
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-switch"
        self.mtu = mtu
        self.hosts: dict[str, Host] = {}
        self._shaped = shaped
        self._names = list(names)
        self._subnet = subnet

    def __enter__(self) -> TestBed:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> None:
        """Make the switch and every host; on any failure, undo what was made."""
        reason = unavailable_reason()
        if reason is not None:
            raise TestBedUnavailable(reason)
        sweep_stale_beds()
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "mtu", str(self.mtu), "up")
            for index, name in enumerate(self._names, start=1):
                self.hosts[name] = self._make_host(name, index)
        except BaseException:
            self.close()
            raise

    def _make_host(self, name: str, index: int) -> Host:
        netns = f"{self.tag}-{name}"
        port = f"port{index}"
        shm = SHM_ROOT / self.tag / name
        shm.mkdir(parents=True)
        host = Host(name, netns, f"{self._subnet}.{index}", port, shm)
        _ip("netns", "add", netns)
        self.hosts[name] = host  # torn down with the bed from here on
        if name in self._shaped:
            from asyncrl.testbed.shaper import ShapedLink

            host.link = ShapedLink(netns, "eth0", self.switch, port, mtu=self.mtu, seed=index)
        else:
            _ip("link", "add", "eth0", "netns", netns, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", port, "netns", self.switch, "mtu", str(self.mtu))
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    # --- faults -------------------------------------------------------------------------

    def shape(self, name: str, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Delay and drop what host ``name`` sends, as ``netem`` on its interface would."""
        link = self.hosts[name].link
        if link is None:
            raise ValueError(f"host {name!r} has a plain cable; name it in `shaped` to shape it")
        link.set(delay_ms, loss)

    def limit(self, name: str, rate: str | None) -> None:
        """Limit host ``name``'s cable to ``rate`` (tc syntax: ``1gbit``) both ways; None: lift."""
        host = self.hosts[name]
        # burst: a few ms at the rate (at least 64 KiB), so the rate holds with GSO's large
        # packets; latency bounds the queue as a switch's buffer would. Checked first: a
        # bad rate leaves the limit as it was
        burst = None if rate is None else max(64 * 1024, _bits(rate) // 8 // 250)
        for netns, dev in ((host.netns, "eth0"), (self.switch, host.port)):
            with contextlib.suppress(RuntimeError):
                _tc(netns, "qdisc", "del", "dev", dev, "root")
            if rate is not None:
                _tc(netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", str(burst), "latency", "50ms")

    def bytes_toward(self, name: str) -> int:
        """Bytes the switch has sent down host ``name``'s cable so far (its port's counter)."""
        shown = _ip("-j", "-s", "-n", self.switch, "link", "show", self.hosts[name].port).stdout
        return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])

    def wait_for_transfer(
        self, name: str, rate_bits: float, window_s: float = 0.3, timeout_s: float = 60.0
    ) -> None:
        """Return once host ``name`` is receiving at least half of ``rate_bits`` over
        ``window_s`` (a bulk transfer is under way on its cable); RuntimeError after
        ``timeout_s`` without one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            before = self.bytes_toward(name)
            time.sleep(window_s)
            if (self.bytes_toward(name) - before) * 8 >= 0.5 * rate_bits * window_s:
                return
        raise RuntimeError(f"no transfer toward host {name} in {timeout_s:.0f}s")

    def cut(self, name: str) -> None:
        """Pull host ``name``'s cable: its switch port goes down (the host keeps its address)."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def restore(self, name: str) -> None:
        """Plug host ``name``'s cable back in."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    # --- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """End every process on every host, then delete the namespaces; idempotent."""
        for host in self.hosts.values():
            end_processes(host.netns)
            for process in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=GRACE_S)
            if host.link is not None:
                host.link.close()
            _ip("netns", "del", host.netns, check=False)
        self.hosts.clear()
        _ip("netns", "del", self.switch, check=False)
        shutil.rmtree(SHM_ROOT / self.tag, ignore_errors=True)


def _bits(rate: str) -> int:
    """A tc rate (``10gbit``, ``500mbit``, ``1000000bit``) in bits per second."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not a tc rate such as 1gbit, 500mbit or 64kbit")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)

