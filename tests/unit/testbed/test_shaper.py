"""The shaped link: a userspace relay between two TAP devices is a host's cable, with the
delay and loss it is set to on the host's egress (this kernel has no netem to do it).

Two hosts on one bridge: A behind a :class:`ShapedLink`, B behind a plain veth pair. The
tests need root, ``ip`` and network namespaces, and skip where any is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from asyncrl.testbed.hosts import unavailable_reason
from asyncrl.testbed.shaper import ShapedLink

A_ADDRESS, B_ADDRESS = "10.99.0.1", "10.99.0.2"
ECHO_PORT, UDP_PORT = 7000, 7001

ECHO_SERVER = f"""
import socket, threading
server = socket.create_server(({B_ADDRESS!r}, {ECHO_PORT}))
print("ready", flush=True)
def serve(conn):
    with conn:
        while data := conn.recv(1 << 16):
            conn.sendall(data)
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""

ECHO_1MB = f"""
import hashlib, os, socket, threading
data = os.urandom(1 << 20)
conn = socket.create_connection(({B_ADDRESS!r}, {ECHO_PORT}), timeout=30)
def send():
    conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
sender = threading.Thread(target=send)
sender.start()
got = bytearray()
while chunk := conn.recv(1 << 16):
    got += chunk
sender.join()
print(hashlib.sha256(data).hexdigest(), hashlib.sha256(got).hexdigest(), len(got))
"""

ROUND_TRIP = f"""
import socket, time
start = time.monotonic()
conn = socket.create_connection(({B_ADDRESS!r}, {ECHO_PORT}), timeout=10)
conn.sendall(b"ping")
answer = conn.recv(16).decode()
print(time.monotonic() - start, answer)
"""

UDP_COUNTER = f"""
import socket
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
sock.bind(({B_ADDRESS!r}, {UDP_PORT}))
sock.settimeout(20)
print("ready", flush=True)
count = 0
while (datagram := sock.recv(2048)) != b"end":
    count += datagram.startswith(b"d")
print(count, flush=True)
"""


def udp_sender(count: int) -> str:
    return f"""
import socket, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range({count}):
    sock.sendto(b"d%d" % i, ({B_ADDRESS!r}, {UDP_PORT}))
    if i % 25 == 24:
        time.sleep(0.002)  # the host's TAP queue holds 500 frames: never near it
"""


@dataclass
class Net:
    a: str
    b: str
    switch: str
    link: ShapedLink


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"


def _in(netns: str, code: str, timeout: float = 30.0) -> str:
    """Run ``code`` in a fresh Python inside ``netns``: its stdout."""
    done = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _start_in(netns: str, code: str) -> subprocess.Popen[str]:
    """Start ``code`` in ``netns`` and wait for its ``ready`` line (``ip netns exec`` execs it:
    the pid is the Python's, to kill by)."""
    process = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        pytest.fail(f"a helper in {netns} did not start: {process.communicate()[1]}")
    return process


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    """A (shaped link) and B (veth) on bridge br0 in the switch namespace SW."""
    reason = unavailable_reason(shaped=True)
    if reason is not None:
        pytest.skip(reason)
    tag = f"{os.getpid()}{secrets.token_hex(3)}"
    a, b, switch = f"shpa{tag}", f"shpb{tag}", f"shpsw{tag}"
    made: list[str] = []
    with contextlib.ExitStack() as cleanup:
        # last in, first out: the relay ends (its TAP devices with it) before the namespaces go
        cleanup.callback(
            lambda: [subprocess.run(["ip", "netns", "del", ns], capture_output=True) for ns in made]
        )
        for netns in (a, b, switch):
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        link = cleanup.enter_context(ShapedLink(a, "eth0", switch, "pa", seed=0))
        _ip("-n", switch, "link", "set", "pa", "master", "br0")
        peer = ("peer", "name", "pb", "netns", switch)
        _ip("link", "add", "eth0", "netns", b, "type", "veth", *peer)
        _ip("-n", switch, "link", "set", "pb", "master", "br0", "up")
        for netns, address in ((a, A_ADDRESS), (b, B_ADDRESS)):
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
        yield Net(a, b, switch, link)


@pytest.fixture(scope="module")
def echo(net: Net) -> Iterator[None]:
    """A TCP echo server on B."""
    server = _start_in(net.b, ECHO_SERVER)
    yield
    server.kill()
    server.communicate()


@pytest.fixture(autouse=True)
def plain_link(net: Net) -> Iterator[None]:
    """Each test starts and ends on a link without delay or loss."""
    net.link.set(0, 0)
    yield
    net.link.set(0, 0)


def _round_trip(net: Net) -> float:
    seconds, answer = _in(net.a, ROUND_TRIP).split()
    assert answer == "ping"
    return float(seconds)


def test_a_megabyte_echoed_over_the_shaped_link_comes_back_intact(net: Net, echo: None) -> None:
    sent, received, length = _in(net.a, ECHO_1MB).split()
    assert (received, int(length)) == (sent, 1 << 20)


def test_the_delay_is_on_every_frame_the_host_sends(net: Net, echo: None) -> None:
    before = net.link.stats()
    net.link.set(100, 0)
    # the SYN and then the data each wait 100 ms on their way out of A: 0.2 s at least
    assert _round_trip(net) >= 0.2
    net.link.set(0, 0)
    assert _round_trip(net) < 0.2  # settings change at once: no delay left
    after = net.link.stats()
    assert after[0] > before[0] and after[2] > before[2], (before, after)


def test_half_the_host_datagrams_are_lost_and_counted(net: Net, echo: None) -> None:
    _round_trip(net)  # both neighbours resolved while nothing is lost
    counter = _start_in(net.b, UDP_COUNTER)
    try:
        before = net.link.stats()
        net.link.set(0, 0.5)
        _in(net.a, udp_sender(400))
        after = net.link.stats()
        net.link.set(0, 0)
        end = f"import socket; socket.socket(2, 2).sendto(b'end', ({B_ADDRESS!r}, {UDP_PORT}))"
        _in(net.a, end)  # after every datagram, and not lost: the counter stops
        received = int(counter.communicate(timeout=20)[0])
    finally:
        counter.kill()
    forwarded, dropped = after[0] - before[0], after[1] - before[1]
    assert 100 < received < 300
    assert dropped + forwarded >= 400 and dropped >= 400 - received, (before, after, received)


def test_settings_out_of_range_are_refused_by_name(net: Net) -> None:
    with pytest.raises(ValueError, match="delay_ms"):
        net.link.set(-1, 0)
    with pytest.raises(ValueError, match="loss"):
        net.link.set(0, 1.0)
    with pytest.raises(ValueError, match="loss"):
        net.link.set(0, float("nan"))
