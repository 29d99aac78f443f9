"""Test hosts as network namespaces on a private switch: addresses, isolation, per-host
``/dev/shm``, cuts, rate limits, shaping and teardown, each checked by traffic between hosts.

The tests need root, ``ip`` and ``tc`` and network namespaces, and skip with
:func:`unavailable_reason`'s reason where any is missing. Every bed they make is closed
however a test ends, and a module-level net deletes whatever namespace of theirs is left.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.testbed.hosts import (
    PREFIX,
    SHM_ROOT,
    SUBNET,
    sweep_stale_beds,
    unavailable_reason,
)
from asyncrl.testbed.hosts import TestBed as Bed  # as itself, pytest would try to collect it

ECHO_PORT, SINK_PORT = 7100, 7101
PAYLOAD = 2 * 1024 * 1024
"""Bytes sent across a limited cable: 16.8 Mbit, about 2.1 s at 8 Mbit/s."""

SERVER = f"""
import socket, sys, threading
address = sys.argv[1]
echo = socket.create_server((address, {ECHO_PORT}))
sink = socket.create_server((address, {SINK_PORT}))
print("ready", flush=True)
def echo_back(conn):
    with conn:
        while data := conn.recv(1 << 16):
            conn.sendall(data)
def count(conn):  # reads to EOF, then answers how many bytes came
    with conn:
        got = 0
        while data := conn.recv(1 << 16):
            got += len(data)
        conn.sendall(str(got).encode())
def serve(server, handle):
    while True:
        threading.Thread(target=handle, args=(server.accept()[0],), daemon=True).start()
threading.Thread(target=serve, args=(sink, count), daemon=True).start()
serve(echo, echo_back)
"""

CONNECT = f"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], {ECHO_PORT}), timeout=float(sys.argv[2])).close()
    print("connected")
except OSError as error:
    print("failed", repr(error))
"""

ROUND_TRIP = f"""
import socket, sys, time
start = time.monotonic()
conn = socket.create_connection((sys.argv[1], {ECHO_PORT}), timeout=10)
conn.sendall(b"ping")
answer = conn.recv(16).decode()
print(time.monotonic() - start, answer)
"""

SEND = f"""
import socket, sys, time
data = bytes({PAYLOAD})
start = time.monotonic()
conn = socket.create_connection((sys.argv[1], {SINK_PORT}), timeout=20)
conn.sendall(data)
conn.shutdown(socket.SHUT_WR)
answer = conn.recv(64).decode()
print(time.monotonic() - start, answer)
"""

PERSISTENT = f"""
import socket, sys
conn = socket.create_connection((sys.argv[1], {ECHO_PORT}), timeout=5)
conn.settimeout(10)  # the longest a line may take to come back: the client then ends
print("connected", flush=True)
while line := sys.stdin.readline():
    data = line.encode()
    conn.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise SystemExit("the connection closed")
        got += chunk
    print(got.decode().strip(), flush=True)
"""

MADE: list[str] = []
"""The tags of every bed made here: a leftover namespace of theirs is deleted at the end."""


def _netns_names() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


@pytest.fixture(scope="module", autouse=True)
def _available_and_swept() -> Iterator[None]:
    """Skip where test hosts cannot be made; at the end, no namespace of these tests is left."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    yield
    left = [name for name in _netns_names() if any(name.startswith(tag) for tag in MADE)]
    for name in left:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert not left, f"namespaces outlived their beds: {left}"


def _bed(names: tuple[str, ...], **kwargs) -> Bed:
    bed = Bed(names, **kwargs)
    MADE.append(bed.tag)
    return bed


@contextlib.contextmanager
def _started(names: tuple[str, ...], **kwargs) -> Iterator[Bed]:
    with _bed(names, **kwargs) as bed:
        yield bed


def _serve(bed: Bed, name: str = "a") -> subprocess.Popen[str]:
    """The echo and count servers on host ``name``, listening on its address only."""
    server = bed[name].popen(
        [sys.executable, "-c", SERVER, bed[name].address], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        pytest.fail(f"the server on {name} did not start (exit {server.wait(5)})")
    return server


def _python(bed: Bed, name: str, code: str, *args: str, timeout: float = 30) -> str:
    done = bed[name].run([sys.executable, "-c", code, *args], timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _connect(bed: Bed, source: str, target: str, timeout_s: float) -> str:
    return _python(bed, source, CONNECT, bed[target].address, str(timeout_s))


def _round_trip(bed: Bed, source: str, target: str) -> float:
    seconds, answer = _python(bed, source, ROUND_TRIP, bed[target].address).split()
    assert answer == "ping"
    return float(seconds)


def _send(bed: Bed, source: str, target: str) -> float:
    seconds, received = _python(bed, source, SEND, bed[target].address).split()
    assert int(received) == PAYLOAD
    return float(seconds)


def _echoed_from_here(address: str, timeout_s: float) -> bool:
    """Whether the echo server at ``address`` answers this process (the root namespace)."""
    token, got = secrets.token_hex(8).encode(), b""
    try:
        with socket.create_connection((address, ECHO_PORT), timeout=timeout_s) as conn:
            conn.sendall(token)
            while token not in got and (chunk := conn.recv(1 << 16)):
                got += chunk
    except OSError:
        return False
    return token in got


def _qdisc(bed: Bed, name: str) -> tuple[str, str]:
    """``tc qdisc show`` on both ends of host ``name``'s cable: (host side, switch side)."""
    host = bed[name].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    port = ["ip", "netns", "exec", bed.switch, "tc", "qdisc", "show", "dev", bed[name].port]
    return host, subprocess.run(port, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    """Hosts a, b, c; a runs the echo and count servers."""
    with _started(("a", "b", "c")) as made:
        _serve(made)
        yield made


@pytest.fixture
def plain(bed: Bed) -> Iterator[Bed]:
    """The module's bed, with every cable plugged in and unlimited after the test."""
    yield bed
    for name in bed.hosts:
        bed.restore(name)
        bed.limit(name, None)


def test_hosts_get_addresses_in_order_and_reach_each_other_not_the_machine(bed: Bed) -> None:
    assert [bed[name].address for name in ("a", "b", "c")] == [f"{SUBNET}.{i}" for i in (1, 2, 3)]
    for name in ("a", "b", "c"):
        shown = bed[name].run(["ip", "-4", "addr", "show", "dev", "eth0"]).stdout
        assert f"inet {bed[name].address}/24" in shown, shown
    # the server listens on a's address alone, under the pid popen gave (the bed ends it by pid)
    server = bed["a"].processes[0]
    assert (bed["a"].address, ECHO_PORT, server.pid) in bed["a"].listeners()
    _round_trip(bed, "b", "a")
    assert _connect(bed, "c", "a", 2.0) == "connected"
    # the machine itself has no way into the bed: its connect fails, times out, or (where the
    # machine's network answers every address, as a transparent proxy does) meets a stranger
    start = time.monotonic()
    assert not _echoed_from_here(bed["a"].address, timeout_s=1.0)
    assert time.monotonic() - start < 3.0


def test_each_host_has_its_own_dev_shm_removed_with_the_bed() -> None:
    name = f"test-hosts-{os.getpid()}-{time.monotonic_ns()}"
    with contextlib.ExitStack() as cleanup:
        # a bed that failed to mount its own /dev/shm would leave the file in the machine's
        cleanup.callback(lambda: (SHM_ROOT / name).unlink(missing_ok=True))
        bed = cleanup.enter_context(_started(("a", "b")))
        own = SHM_ROOT / bed.tag / "a"
        assert bed["a"].shm == own
        written = bed["a"].run(["sh", "-c", f"echo weights > /dev/shm/{name} && ls /dev/shm"])
        assert written.returncode == 0 and name in written.stdout.split(), written
        seen_by_b = bed["b"].run(["ls", "-A", "/dev/shm"])
        assert seen_by_b.returncode == 0 and name not in seen_by_b.stdout.split()
        assert bed["b"].run(["cat", f"/dev/shm/{name}"]).returncode != 0
        # the machine's /dev/shm holds it only in a's own folder
        found = [Path(top) / name for top, _, files in os.walk(SHM_ROOT) if name in files]
        assert found == [own / name]
        assert (own / name).read_text() == "weights\n"
    assert not (SHM_ROOT / bed.tag).exists()
    assert not any(name in files for _, _, files in os.walk(SHM_ROOT))


def test_a_cut_cable_refuses_connections_and_a_connection_survives_it(plain: Bed) -> None:
    bed = plain
    client = bed["b"].popen(
        [sys.executable, "-c", PERSISTENT, bed["a"].address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None

    def say(line: str) -> None:
        client.stdin.write(line + "\n")
        client.stdin.flush()

    try:
        assert client.stdout.readline().strip() == "connected"
        say("before")
        assert client.stdout.readline().strip() == "before"
        bed.cut("b")
        try:
            say("during")  # sent into the cut: TCP retransmits it
            start = time.monotonic()
            assert _connect(bed, "b", "a", 2.0).startswith("failed")
            time.sleep(max(0.0, 2.0 - (time.monotonic() - start)))  # a 2 s cut, "during" pending
        finally:
            bed.restore("b")
        say("after")
        assert client.stdout.readline().strip() == "during"
        assert client.stdout.readline().strip() == "after"
        assert _connect(bed, "b", "a", 2.0) == "connected"
    finally:
        client.stdin.close()
        client.wait(timeout=15)
    assert client.returncode == 0


def test_a_limited_cable_is_slow_and_lifting_the_limit_makes_it_fast(plain: Bed) -> None:
    bed = plain
    bed.limit("b", "8mbit")
    host_side, switch_side = _qdisc(bed, "b")
    assert "tbf" in host_side and "rate 8Mbit" in host_side, host_side
    assert "tbf" in switch_side and "rate 8Mbit" in switch_side, switch_side
    assert "tbf" not in _qdisc(bed, "c")[0]  # another host's cable is untouched
    limited = _send(bed, "b", "a")
    bed.limit("b", None)
    host_side, switch_side = _qdisc(bed, "b")
    assert "tbf" not in host_side and "tbf" not in switch_side, (host_side, switch_side)
    unlimited = _send(bed, "b", "a")
    assert limited >= 1.5, limited  # 16.8 Mbit at 8 Mbit/s: 2.1 s, less the 64 KiB burst
    assert unlimited < limited / 2, (limited, unlimited)


def test_a_transfer_toward_a_host_is_seen_on_its_cable_and_only_there(plain: Bed) -> None:
    # how a test cuts a cable in the middle of a transfer, not between two
    plain.limit("a", "8mbit")
    sender = threading.Thread(target=_send, args=(plain, "b", "a"))
    sender.start()
    try:
        plain.wait_for_transfer("a", 8e6, timeout_s=10)
        with pytest.raises(RuntimeError, match="no transfer toward host c"):
            plain.wait_for_transfer("c", 8e6, timeout_s=0.5)
    finally:
        sender.join(timeout=30)
    assert plain.bytes_toward("a") > 2 * 10**6 > plain.bytes_toward("c")


def test_a_bad_rate_is_refused_and_leaves_the_limit_as_it_was(plain: Bed) -> None:
    plain.limit("b", "8mbit")
    try:
        with pytest.raises(ValueError, match="'8mbps' is not a tc rate"):
            plain.limit("b", "8mbps")
        host_side, switch_side = _qdisc(plain, "b")
        assert "rate 8Mbit" in host_side and "rate 8Mbit" in switch_side, (host_side, switch_side)
    finally:
        plain.limit("b", None)


@pytest.mark.parametrize("name", ["switch", "B", "a-b", "", "x" * 17])
def test_a_host_name_that_cannot_name_a_namespace_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="host name"):
        Bed(("a", name))


def test_close_ends_the_processes_and_deletes_every_namespace_twice_over() -> None:
    bed = _bed(("a", "b"))
    try:
        bed.start()
        sleeper = bed["a"].popen(["sleep", "600"])
        assert sum(name.startswith(bed.tag) for name in _netns_names()) == 3
        assert sleeper.poll() is None
    finally:
        bed.close()
    assert sleeper.poll() is not None
    assert [name for name in _netns_names() if name.startswith(bed.tag)] == []
    assert not (SHM_ROOT / bed.tag).exists()
    bed.close()  # a second close finds nothing to do and does not fail


def test_sweep_deletes_beds_of_dead_processes_and_keeps_live_ones(bed: Bed) -> None:
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = f"{PREFIX}-{finished.pid}-test-x"
    stale_shm = SHM_ROOT / stale
    MADE.append(stale)
    try:
        subprocess.run(["ip", "netns", "add", stale], check=True, capture_output=True)
        stale_shm.mkdir()
        swept = sweep_stale_beds()
        assert stale in swept
        assert stale not in _netns_names()
        assert not stale_shm.exists()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        with contextlib.suppress(FileNotFoundError):
            stale_shm.rmdir()
    # this process's bed is alive: left alone, and still carrying traffic
    assert not any(name.startswith(bed.tag) for name in swept)
    assert {f"{bed.tag}-{name}" for name in ("a", "b", "c", "switch")} <= set(_netns_names())
    assert (SHM_ROOT / bed.tag / "a").is_dir()
    assert _connect(bed, "b", "a", 2.0) == "connected"


def test_a_shaped_host_delays_what_it_sends_and_a_plain_one_refuses_shaping() -> None:
    with pytest.raises(ValueError, match="'z'"):
        Bed(("a",), shaped=("z",))
    with _started(("a", "b"), shaped=("b",)) as bed:
        assert bed["a"].link is None and bed["b"].link is not None
        _serve(bed)
        plain = _round_trip(bed, "b", "a")  # neighbours resolved, nothing delayed
        bed.shape("b", 100, 0)
        # the SYN and then the data each wait 100 ms on their way out of b
        shaped = _round_trip(bed, "b", "a")
        assert shaped >= 0.2, shaped
        bed.shape("b", 0, 0)
        assert _round_trip(bed, "b", "a") < shaped - 0.1, (plain, shaped)
        with pytest.raises(ValueError, match="'a'"):
            bed.shape("a", 100, 0)
