"""Bounds what the peers of a listening ZeroMQ socket can make its process hold.

``ZMQ_MAXMSGSIZE`` (set here from :class:`~asyncrl.core.message_limits.GuardLimits`)
caps each frame a peer sends, the handshake's commands included: libzmq reads the
declared size first and drops the connection when it is over the cap. Two things
it leaves open, which a :class:`ConnectionGuard` closes for one ROUTER socket, from
a thread of its own:

- **connections in their handshake.** libzmq accepts every connection and reads
  its handshake, up to a frame's cap each, for up to ``ZMQ_HANDSHAKE_IVL``. The
  guard keeps at most ``limits.unauthenticated`` connections not known to be past
  their handshake and shuts down the oldest beyond (``refused_unauthenticated``).
- **bytes held per connection.** libzmq keeps a multipart message whole until its
  last frame, whatever its number of frames, at 64 bytes a frame however small
  (60 MiB of one-byte frames took 1.3 GB). The guard shuts a connection that has
  sent more than ``limits.held_bytes`` the server has not received
  (``dropped_held_bytes``).

It also counts the connections libzmq closes while their peer still holds them:
before login (``dropped_in_handshake``: a command over the frame cap, refused
credentials, a handshake timeout) and after (``dropped_after_login``: a frame over
the cap or broken framing; on the weights server also a peer that stopped
answering heartbeats).

How it sees connections. A socket monitor reports the file descriptor of each
accepted connection (``ACCEPTED``) and of each closed one, in order. The guard
keeps a duplicate of each, so what it reads or shuts down is always the
connection it recorded, even once libzmq has closed its descriptor and the number
is reused; a connection is over when libzmq's descriptor no longer names the same
socket (:func:`_same_socket`, checked on every turn). The server reports the
descriptor each message came from (``ZMQ_SRCFD``) and its size (:meth:`received`):
a message means its connection is past the handshake, and so does being open
longer than the handshake timeout (libzmq drops an unfinished one). Bytes held are
what TCP received (``TCP_INFO``) less what is still in the kernel's queue
(``SIOCINQ``), less what the server received, read every ``WATCH_INTERVAL_S``: a
peer can exceed the limit by what it sends in that time. The held-bytes watch
needs Linux; elsewhere the guard counts and bounds connections only.

Shutting a connection down (``shutdown(2)`` on the duplicate) makes libzmq read an
end of stream and close it; the peer sees its connection close and reconnects.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import sys
import termios
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from asyncrl.core.message_limits import GuardLimits

log = logging.getLogger("asyncrl.connections")

WATCH_INTERVAL_S = 0.02
"""How often the guard reads each connection's bytes and looks for closed ones."""
IDLE_POLL_S = 0.1
"""How long the guard waits for an event while no connection is open (and how long
:meth:`ConnectionGuard.stop` may wait for it)."""
LOG_INTERVAL_S = 10.0
"""At most one log line per kind of refusal this often, with the count since the last."""
FRAME_CREDIT = 64
"""Bytes credited per received frame beyond its payload: ZMTP framing (2 or 9 bytes),
CURVE's box (33) and heartbeat commands fit in it. Credit never exceeds what was read,
so a generous one lets no peer bank an allowance."""
IDLE_CREDIT_PER_S = 64
"""Bytes credited to every connection per second, whatever it sent: heartbeat commands
(ZMTP PING and PONG, tens of bytes every few seconds) reach no server as messages."""
MONITOR_QUEUE = 100_000
"""Monitor events queued for the guard before libzmq drops them (a connection flood)."""
COUNTS = (
    "refused_unauthenticated",
    "dropped_held_bytes",
    "dropped_in_handshake",
    "dropped_after_login",
)
"""The guard's counters, each 0 until it happens."""
GAUGES = ("open", "unauthenticated")
"""What :meth:`ConnectionGuard.stats` reports beside the counters: connections open now,
and those not yet past their handshake."""
_TCP_BYTES_RECEIVED = struct.Struct("=Q")
_TCP_BYTES_RECEIVED_OFFSET = 128
"""``tcpi_bytes_received`` in Linux's ``struct tcp_info`` (since 4.1)."""
_REPORT_TURNS = 2
"""Turns a report from a connection not recorded yet is kept: the server can receive a
connection's first message before the guard has read that it was accepted."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


@dataclass
class Connection:
    """One accepted connection, through the guard's own descriptor of its socket."""

    fd: int
    """libzmq's descriptor (what ``ACCEPTED`` and ``ZMQ_SRCFD`` name)."""
    dup: socket.socket
    opened_at: float
    past_handshake: bool = False
    accounted: int = 0
    """Bytes of what libzmq read from it that the server received, or credited."""
    credit: int = 0
    """Received bytes (and per-frame credit) reported since the last turn."""
    shut_by_guard: bool = False


class ConnectionGuard:
    """Watches ``socket``'s connections from a thread: bounds those in their handshake
    and the bytes each holds, and counts the ones refused or dropped.

    Make it before the socket binds (it sets ``ZMQ_MAXMSGSIZE`` and
    ``ZMQ_HANDSHAKE_IVL``); call :meth:`received` for every message the server
    receives, and :meth:`stop` from the socket's thread before closing it.
    """

    def __init__(self, sock: zmq.Socket, limits: GuardLimits, name: str):
        self.limits = limits
        self.name = name
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        self._socket = sock
        self._reports: deque[tuple[int, int]] = deque()
        self._unmatched: list[tuple[int, int, int]] = []
        """Reports of descriptors not recorded yet: ``(fd, bytes, turns kept)``."""
        self._stopping = threading.Event()
        self._connections: dict[int, Connection] = {}
        self._log = RateLimitedLog(LOG_INTERVAL_S)
        self._watch_bytes = _reads_tcp_info()
        self._watched_at = time.monotonic()
        sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_bytes)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(limits.handshake_timeout_s * 1000))
        address = f"inproc://asyncrl-connection-guard-{id(self):x}"
        sock.monitor(address, _EVENTS)
        self._monitor = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, MONITOR_QUEUE)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._thread = threading.Thread(target=self._watch_loop, name=f"{name}-guard", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- the server's side

    def received(self, frames: list[zmq.Frame]) -> None:
        """Note one message the server received (its frames, routing frame first, as
        ``recv_multipart(copy=False)`` gives them): its connection is past the handshake."""
        fd = frames[0].get(zmq.SRCFD)
        self._reports.append((fd, sum(len(frame) + FRAME_CREDIT for frame in frames[1:])))

    def stats(self) -> dict[str, int]:
        """Every counter, and the connections open and not yet past their handshake now."""
        connections = list(self._connections.values())  # one C-level copy: the thread goes on
        gauges = (len(connections), sum(_waiting(c) for c in connections))
        return dict(self.counts) | dict(zip(GAUGES, gauges, strict=True))

    def stop(self) -> None:
        """Stop watching (from the socket's thread, before it is closed)."""
        self._stopping.set()
        if not self._socket.closed:
            self._socket.disable_monitor()
        self._thread.join(timeout=5)

    # --------------------------------------------------------------- guard thread

    def _watch_loop(self) -> None:
        try:
            while not self._stopping.is_set() and self._turn():
                pass
        finally:
            self._monitor.close(linger=0)
            for connection in self._connections.values():
                connection.dup.close()
            self._connections.clear()

    def _turn(self) -> bool:
        """Take the monitor's events, then act on what they and the server reported;
        False once the monitor stopped."""
        wait_s = WATCH_INTERVAL_S if self._connections else IDLE_POLL_S
        if self._monitor.poll(int(wait_s * 1000)):
            while True:
                try:
                    event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return False
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self._opened(int(event["value"]), event["endpoint"], time.monotonic())
                # DISCONNECTED only wakes the guard: libzmq's descriptor says which ended
        now = time.monotonic()
        self._take_reports()
        self._forget_closed()
        for connection in self._connections.values():
            if now - connection.opened_at > self.limits.handshake_timeout_s:
                connection.past_handshake = True  # else libzmq would have dropped it
        self._refuse_beyond_limit()
        if self._watch_bytes:
            self._watch_held_bytes(IDLE_CREDIT_PER_S * (now - self._watched_at))
        self._watched_at = now
        return True

    def _opened(self, fd: int, endpoint: bytes, now: float) -> None:
        """Record the connection libzmq accepted as ``fd`` on ``endpoint``, through a
        descriptor of the guard's own."""
        known = self._connections.get(fd)
        if known is not None:
            if _same_socket(fd, known.dup):
                known.opened_at = now  # recorded early, under a number reused since (below)
                return
            self._ended(known)
        dup = _duplicate(fd, _port(endpoint))
        if dup is None:  # closed already, or the number now names something else
            return
        # if libzmq closed ``fd`` and accepted another connection under the same number
        # before this event was read, ``dup`` is that newer one: its own ACCEPTED follows
        # and finds it recorded (above), so it is only ever older than it looks
        self._connections[fd] = Connection(fd, dup, now)

    def _take_reports(self) -> None:
        """Credit each connection the messages the server received from it."""
        unmatched, self._unmatched = self._unmatched, []
        while self._reports:
            fd, nbytes = self._reports.popleft()
            unmatched.append((fd, nbytes, 0))
        for fd, nbytes, turns in unmatched:
            connection = self._connections.get(fd)
            if connection is not None:
                connection.past_handshake = True
                connection.credit += nbytes
            elif turns < _REPORT_TURNS:
                self._unmatched.append((fd, nbytes, turns + 1))

    def _forget_closed(self) -> None:
        """Drop the connections libzmq has closed, counting those it closed on a peer
        that still held them (an oversized frame or command, a refused handshake)."""
        for connection in [c for c in self._connections.values() if not _same_socket(c.fd, c.dup)]:
            self._ended(connection)

    def _ended(self, connection: Connection) -> None:
        """Forget a connection libzmq closed; count it if its peer had not closed it."""
        if not connection.shut_by_guard and _peer_still_there(connection.dup):
            if connection.past_handshake:
                self._report(
                    "dropped_after_login",
                    "libzmq closed a connection after login: a frame over "
                    f"{self.limits.frame_bytes} bytes (ZMQ_MAXMSGSIZE) or broken framing",
                )
            else:
                self._report(
                    "dropped_in_handshake",
                    "libzmq closed a connection in its handshake: a command over "
                    f"{self.limits.frame_bytes} bytes, refused credentials or a timeout",
                )
        connection.dup.close()
        del self._connections[connection.fd]

    def _refuse_beyond_limit(self) -> None:
        """Shut the oldest connections still in their handshake beyond the limit."""
        waiting = [c for c in self._connections.values() if _waiting(c)]
        for connection in waiting[: max(0, len(waiting) - self.limits.unauthenticated)]:
            self._shut(connection)
            self._report(
                "refused_unauthenticated",
                f"more than {self.limits.unauthenticated} connections in their handshake "
                "at once: shut the oldest",
            )

    def _watch_held_bytes(self, idle_credit: float) -> None:
        """Shut each connection that has sent more than ``held_bytes`` not yet received."""
        for connection in self._connections.values():
            if connection.shut_by_guard:
                continue
            try:
                read = _bytes_read(connection.dup)
            except OSError:
                continue  # closed under us: the next turn forgets it
            credit = connection.credit + int(idle_credit)
            connection.accounted = min(connection.accounted + credit, read)
            connection.credit = 0
            held = read - connection.accounted
            if held > self.limits.held_bytes:
                self._shut(connection)
                self._report(
                    "dropped_held_bytes",
                    f"a connection sent {held} bytes the server has not received (a message "
                    f"of endless frames?), over {self.limits.held_bytes}: shut it",
                )

    def _shut(self, connection: Connection) -> None:
        connection.shut_by_guard = True
        with contextlib.suppress(OSError):  # already gone
            connection.dup.shutdown(socket.SHUT_RDWR)

    def _report(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        count = self._log.due(kind)
        if count:
            log.warning("%s: %s (%d in the last %.0fs)", self.name, detail, count, LOG_INTERVAL_S)


def _duplicate(fd: int, port: int) -> socket.socket | None:
    """A descriptor of the guard's own for the TCP connection ``fd`` names, accepted on
    ``port``; None when ``fd`` is closed or names something else by now."""
    try:
        copy = os.dup(fd)
    except OSError as error:
        if error.errno in (errno.EMFILE, errno.ENFILE):
            log.warning("cannot watch a connection: %s", error)
        return None
    try:
        dup = socket.socket(fileno=copy)
        if dup.family in (socket.AF_INET, socket.AF_INET6) and dup.getsockname()[1] == port:
            return dup
        dup.close()
    except OSError:  # not a socket
        os.close(copy)
    return None


def _waiting(connection: Connection) -> bool:
    """Not known to be past its handshake, and not already shut."""
    return not connection.past_handshake and not connection.shut_by_guard


def _same_socket(fd: int, dup: socket.socket) -> bool:
    """Whether libzmq's ``fd`` still names the socket the guard holds as ``dup``: while
    the guard holds it, no other socket can take its inode."""
    try:
        theirs, ours = os.fstat(fd), os.fstat(dup.fileno())
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _peer_still_there(dup: socket.socket) -> bool:
    """After libzmq closed its descriptor: whether the peer had not closed its end
    (nothing read, or bytes left unread), so libzmq was the one that closed."""
    try:
        return dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True  # open, and nothing more sent
    except OSError:
        return False  # reset by the peer


def _bytes_read(dup: socket.socket) -> int:
    """Bytes of this connection that left the kernel's queue (read by libzmq)."""
    info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    (received,) = _TCP_BYTES_RECEIVED.unpack_from(info, _TCP_BYTES_RECEIVED_OFFSET)
    (queued,) = struct.unpack("i", fcntl.ioctl(dup.fileno(), termios.FIONREAD, b"\0\0\0\0"))
    return received - queued


def _reads_tcp_info() -> bool:
    """Whether this kernel reports ``tcpi_bytes_received`` (Linux 4.1 and later)."""
    if sys.platform != "linux":
        return False
    with socket.socket() as probe:
        info = probe.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return len(info) >= _TCP_BYTES_RECEIVED_OFFSET + _TCP_BYTES_RECEIVED.size


def _port(endpoint: bytes) -> int:
    """The port of ``tcp://HOST:PORT``."""
    return int(endpoint.rsplit(b":", 1)[1])


class RateLimitedLog:
    """At most one line per reason per ``interval_s``: :meth:`due` says when, and how many."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._count: Counter[str] = Counter()

    def due(self, reason: str) -> int:
        """Count one more ``reason``; the count since the last line if one is due now, else 0."""
        self._count[reason] += 1
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            return 0
        self._last[reason] = now
        return self._count.pop(reason)
