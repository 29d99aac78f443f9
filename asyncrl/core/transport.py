"""ZeroMQ plumbing shared by every role: endpoints, sockets and typed round trips.

Clients use DEALER sockets and servers ROUTER sockets, so a server can answer
some requests later (the learner's batch request) while serving others. Every
socket has a zero linger and finite timeouts: a peer that dies never leaves a
sender blocked forever.
"""

from __future__ import annotations

import socket
from collections import Counter

import numpy as np
import zmq

from asyncrl.core.messages import WireError, _Body, decode, encode


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def client_socket(context: zmq.Context, endpoint: str, timeout_s: float = 60.0) -> zmq.Socket:
    """A connected DEALER whose sends and receives give up after ``timeout_s``."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.connect(endpoint)
    return sock


class RequestClient:
    """Blocking request/reply over a DEALER socket, one request in flight at a time."""

    def __init__(self, context: zmq.Context, endpoint: str, timeout_s: float = 60.0):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.socket = client_socket(context, endpoint, timeout_s)
        self.errors: Counter[str] = Counter()

    def request(
        self,
        body: _Body,
        arrays: dict[str, np.ndarray] | None = None,
        timeout_s: float | None = None,
    ):
        """Send ``body`` and return the decoded ``(reply, arrays)``; TimeoutError if none comes."""
        self.send(body, arrays)
        return self.receive(timeout_s)

    def send(self, body: _Body, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Send ``body`` only, for a caller that waits for the reply in slices (``receive``)."""
        self.socket.send_multipart(encode(body, arrays), copy=False)

    def receive(self, timeout_s: float | None = None):
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply from {self.endpoint} within {timeout:.0f}s")
        frames = self.socket.recv_multipart(copy=False)
        try:
            return decode(frames)
        except WireError as error:
            self.errors[error.reason] += 1
            raise

    def close(self) -> None:
        self.socket.close(linger=0)
