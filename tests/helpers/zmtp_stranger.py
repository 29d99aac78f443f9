"""A stranger's bytes to a ZeroMQ server: a ZMTP 3.0 greeting, then a command it streams.

A raw TCP socket speaks the first bytes any peer must, with no credentials: the
64-byte greeting naming the server's mechanism, then a command frame whose header
declares a size, then that many bytes. libzmq reads all of this before anyone has
logged in; before the limits, it allocated the declared size and kept every byte.
"""

from __future__ import annotations

import select
import socket
import struct
import time

GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"PLAIN".ljust(20, b"\0") + bytes(32)
"""ZMTP 3.0: signature, version 3.0, mechanism PLAIN, as-client, filler (64 bytes)."""
COMMAND_LONG = 0x06
"""Frame flags: a command with an 8-byte size."""
CHUNK = bytes(1 << 20)


class Stranger:
    """One connection that sent a greeting and the header of a command of ``declared``
    bytes, then streams its body (:meth:`stream`)."""

    def __init__(self, port: int, declared: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(GREETING)
        self.sock.sendall(bytes([COMMAND_LONG]) + struct.pack("!Q", declared))
        self.sent = 0

    def stream(self, nbytes: int) -> int:
        """Send up to ``nbytes`` of the command's body; the bytes the kernel took before the
        server closed the connection (or all of them)."""
        self.sock.settimeout(2)  # a server that stops reading blocks the send: stop there
        try:
            while self.sent < nbytes:
                self.sent += self.sock.send(CHUNK[: min(len(CHUNK), nbytes - self.sent)])
        except OSError:  # closed by the server (EPIPE, ECONNRESET), or no longer read
            pass
        return self.sent

    def closed_by_server(self, within_s: float = 10.0) -> bool:
        return closed_by_server(self.sock, within_s)

    def close(self) -> None:
        self.sock.close()


def closed_by_server(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the server closed ``sock``'s connection, waiting at most ``within_s`` (what
    it sent meanwhile is read and dropped)."""
    deadline = time.monotonic() + within_s
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        try:
            if readable and sock.recv(1 << 16, socket.MSG_DONTWAIT) == b"":
                return True
        except BlockingIOError:
            pass
        except OSError:
            return True  # reset
        if time.monotonic() >= deadline:
            return False


def command(body: bytes) -> bytes:
    """A command frame: flags, size, body."""
    if len(body) < 256:
        return bytes([0x04, len(body)]) + body
    return bytes([COMMAND_LONG]) + struct.pack("!Q", len(body)) + body


def read_exactly(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = sock.recv(nbytes - len(data))
        if not more:
            raise ConnectionError(f"closed after {len(data)} of {nbytes} bytes")
        data += more
    return data


def read_command(sock: socket.socket) -> bytes:
    flags, size = read_exactly(sock, 2)
    if flags & 0x02:
        size = struct.unpack("!Q", bytes([size]) + read_exactly(sock, 7))[0]
    return read_exactly(sock, size)


def plain_login(port: int, username: bytes, password: bytes) -> socket.socket:
    """A raw connection that logs in with PLAIN as a DEALER (HELLO, INITIATE): an insider
    who holds credentials and can then send frames no libzmq client would (a libzmq
    socket sends a multipart message only once its last frame is written)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(GREETING)
    read_exactly(sock, len(GREETING))
    sock.sendall(
        command(
            b"\x05HELLO" + bytes([len(username)]) + username + bytes([len(password)]) + password
        )
    )
    welcome = read_command(sock)
    assert welcome.startswith(b"\x07WELCOME"), welcome
    metadata = b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
    sock.sendall(command(b"\x08INITIATE" + metadata))
    ready = read_command(sock)
    assert ready.startswith(b"\x05READY"), ready
    return sock


def endless_message(sock: socket.socket, frame_bytes: int, total_bytes: int) -> int:
    """Send frames of ``frame_bytes`` that all say more follows, up to ``total_bytes``:
    a message that never ends. The bytes taken before the server closed the connection."""
    frame = (
        bytes([0x01, frame_bytes]) + bytes(frame_bytes)
        if frame_bytes < 256
        else (bytes([0x03]) + struct.pack("!Q", frame_bytes) + bytes(frame_bytes))
    )
    burst = frame * max(1, (1 << 16) // len(frame))
    sent = 0
    sock.settimeout(2)
    try:
        while sent < total_bytes:
            sock.sendall(burst)
            sent += len(burst)
    except OSError:
        pass
    return sent
