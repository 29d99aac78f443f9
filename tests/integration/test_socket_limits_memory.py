"""The buffer's memory under the attacks that once grew it without bound, in its own process.

The buffer runs as ``asyncrl launch`` starts it (the local ``Supervisor``). Each
attack is measured by the buffer's resident memory: its growth over the attack,
and the peak during it (``VmHWM``, reset first through ``/proc/PID/clear_refs``),
so memory taken and freed again still counts. Before the limits, one stranger's
handshake command of 800 MB took the buffer from 92 to 892 MB, three took it to
2.5 GB, and a generator's credentials put 3 x 400 MB frames in its memory. The
figures are printed (``pytest -s``) for docs/security.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from asyncrl.config import save_config
from asyncrl.core.message_limits import buffer_guard_limits
from asyncrl.core.messages import Status, StatusRequest, encode
from asyncrl.core.security import GENERATOR, OBSERVER, client_context
from asyncrl.core.transport import client_socket, tcp
from asyncrl.run.launch import Supervisor, make_run_dir
from tests.helpers.buffer_wire import buffer_config, exchange
from tests.helpers.zmtp_stranger import Stranger, closed_by_server, endless_message, plain_login

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MIB = 1 << 20
REPLY_TIMEOUT_S = 30.0  # the first request also waits for the buffer process to start
SETTLE_S = 1.0
"""How long the buffer gets to take in (or drop) what an attack sent before it is measured."""


class BufferProcess:
    """The buffer role in its own process, its memory, and clients of the run's roles."""

    def __init__(self, tmp_path: Path):
        self.config = buffer_config("tracking.aim=false", group_size=4)
        self.run_dir = make_run_dir(self.config, tmp_path / "run")
        save_config(self.config, self.run_dir / "config.yaml")
        self.endpoint = tcp("127.0.0.1", self.config.cluster.buffer_port)
        self.port = self.config.cluster.buffer_port
        self.supervisor = Supervisor(self.config, self.run_dir)
        self.supervisor.start("buffer", "buffer")
        self.pid = self.supervisor.processes["buffer"].pid
        self.contexts = {
            role: client_context(self.config.cluster, role) for role in (GENERATOR, OBSERVER)
        }
        self.status()  # up and serving

    def status(self) -> dict[str, float]:
        sock = client_socket(self.contexts[OBSERVER], self.endpoint, REPLY_TIMEOUT_S)
        try:
            status = exchange(sock, StatusRequest())
        finally:
            sock.close(linger=0)
        assert isinstance(status, Status), status
        return status.stats

    def memory_mib(self) -> dict[str, float]:
        """``VmRSS`` and ``VmHWM`` of the buffer process, in MiB."""
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines()
        )
        return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}

    def reset_peak(self) -> float:
        """Reset the peak to the resident memory now; that memory, in MiB."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.memory_mib()["VmRSS"]

    def credentials(self, role: str) -> tuple[bytes, bytes]:
        sock = self.contexts[role].socket(zmq.DEALER)
        try:
            return sock.getsockopt(zmq.PLAIN_USERNAME), sock.getsockopt(zmq.PLAIN_PASSWORD)
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        for context in self.contexts.values():
            context.destroy(linger=0)
        self.supervisor.stop_all()


@pytest.fixture
def buffer(tmp_path) -> Iterator[BufferProcess]:
    running = BufferProcess(tmp_path)
    try:
        yield running
        assert running.supervisor.failure() is None, running.supervisor.failure()
    finally:
        running.close()


def measured(buffer: BufferProcess, attack, capsys, what: str) -> tuple[float, float]:
    """Run ``attack()``; the buffer's growth and peak growth over it, in MiB (printed)."""
    before = buffer.reset_peak()
    attack()
    time.sleep(SETTLE_S)
    after = buffer.memory_mib()
    growth, peak = after["VmRSS"] - before, after["VmHWM"] - before
    with capsys.disabled():
        print(f"\n{what}: {before:.0f} -> {after['VmRSS']:.0f} MiB (peak +{peak:.1f} MiB)")
    return growth, peak


@pytest.mark.parametrize("connections", [1, 3])
def test_a_stranger_s_handshake_flood_costs_the_buffer_almost_nothing(buffer, connections, capsys):
    """N1: greeting, then a command declaring 1 GiB, then 256 MiB of it, on each connection."""
    strangers: list[Stranger] = []

    def flood() -> None:
        for _ in range(connections):
            strangers.append(Stranger(buffer.port, declared=1 << 30))
            strangers[-1].stream(256 * MIB)

    try:
        _, peak = measured(buffer, flood, capsys, f"{connections} stranger(s), 1 GiB commands")
        closed = all(stranger.closed_by_server() for stranger in strangers)
    finally:
        for stranger in strangers:
            stranger.close()
    assert peak < 8 * connections, f"+{peak:.0f} MiB for {connections} connection(s)"
    assert closed
    assert isinstance(buffer.status(), dict)


def test_strangers_holding_commands_under_the_cap_are_bounded_in_number(buffer, capsys):
    """Commands just under the frame cap, each held open: at most ``unauthenticated`` of
    them at once, so the buffer holds at most that many caps."""
    limits = buffer_guard_limits(buffer.config)
    count = limits.unauthenticated + 40
    strangers: list[Stranger] = []

    def flood() -> None:
        for _ in range(count):
            strangers.append(Stranger(buffer.port, declared=limits.frame_bytes))
            strangers[-1].stream(limits.frame_bytes - (64 << 10))  # all but the last 64 KiB

    try:
        _, peak = measured(buffer, flood, capsys, f"{count} strangers, commands under the cap")
        refused = buffer.status()["buffer_connections_refused_unauthenticated"]
    finally:
        for stranger in strangers:
            stranger.close()
    assert refused >= 40
    assert peak < limits.unauthenticated * limits.frame_bytes / MIB + 32


def test_an_insider_s_oversized_frames_never_reach_the_buffer_s_memory(buffer, capsys):
    """N3: a generator's credentials and 3 frames of 400 MB: each connection is dropped at
    its frame's header."""
    context = buffer.contexts[GENERATOR]
    frame = bytes(400 * 1000 * 1000)

    def send() -> None:
        for _ in range(3):
            sock = client_socket(context, buffer.endpoint, REPLY_TIMEOUT_S)
            assert isinstance(exchange(sock, StatusRequest()), Status)  # logged in
            sock.send_multipart([encode(StatusRequest())[0], frame], copy=False)
            assert sock.poll(2000) == 0  # never answered: never read
            sock.close(linger=0)

    _, peak = measured(buffer, send, capsys, "3 x 400 MB frames with a generator's credentials")
    assert peak < 16, f"+{peak:.0f} MiB"
    assert buffer.status()["buffer_connections_dropped_after_login"] == 3


def test_an_insider_s_message_of_endless_empty_frames_is_cut(buffer, capsys):
    """A generator's credentials and a message of empty frames that never ends (64 bytes of
    libzmq's memory for each 2 bytes sent): cut at ``held_bytes`` sent, counted."""
    held = buffer_guard_limits(buffer.config).held_bytes
    insider = plain_login(buffer.port, *buffer.credentials(GENERATOR))

    def send() -> None:
        endless_message(insider, frame_bytes=0, total_bytes=64 * MIB)
        assert closed_by_server(insider)

    try:
        _, peak = measured(buffer, send, capsys, "a message of endless empty frames (insider)")
    finally:
        insider.close()
    assert buffer.status()["buffer_connections_dropped_held_bytes"] == 1
    assert peak < 48 * held / MIB, f"+{peak:.0f} MiB"
