"""A host's cable as a userspace relay between two TAP devices: latency and loss without netem.

This kernel has no ``netem`` qdisc, so ``tc`` cannot make a slow or lossy link. The relay
copies Ethernet frames between a TAP device in the host's namespace and one in the switch's,
and delays and drops the frames the host sends: the semantics of ``tc qdisc add dev eth0 root
netem delay X loss Y`` on the host's interface (its egress only; frames toward it pass as is).

As root: ``python -m asyncrl.testbed.shaper --host-netns NS1 --host-dev eth0 --switch-netns NS2
--switch-dev pX --mtu 1500 --seed 0`` prints ``ready`` once both devices exist. Its stdin takes
``set DELAY_MS LOSS`` (answered ``ok``) and ``stats`` (answered ``stats FORWARDED_OUT
DROPPED_OUT FORWARDED_IN``); EOF or SIGTERM ends it, and the kernel removes each TAP device
when its fd closes. :class:`ShapedLink` starts and drives it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import math
import os
import queue
import random
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
QUEUE_LIMIT = 1000
"""Frames waiting out their delay at most (netem's default ``limit``); more are dropped."""
BURST = 64
"""Frames read from one device per wake-up, so a flood one way cannot starve the other."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _open_tap(name: str, netns: str, dev: str, mtu: int) -> int:
    """A TAP device made here under a temporary name, then moved and renamed: the fd follows."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
        _ip("link", "set", "dev", name, "netns", netns)
        _ip("-n", netns, "link", "set", "dev", name, "name", dev)
        _ip("-n", netns, "link", "set", "dev", dev, "mtu", str(mtu))
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Relay:
    """The copying loop: the host's frames through loss and a FIFO delay line, the rest as is."""

    def __init__(self, host_fd: int, switch_fd: int, seed: int) -> None:
        self.host_fd, self.switch_fd = host_fd, switch_fd
        self.delay_s, self.loss = 0.0, 0.0
        self.rng = random.Random(seed)
        self.line: collections.deque[tuple[float, bytes]] = collections.deque()
        self.forwarded_out = self.dropped_out = self.forwarded_in = 0

    def run(self) -> None:
        commands = b""
        while True:
            # sleep until a frame or command comes, or the first delayed frame is due: no spinning
            timeout = max(0.0, self.line[0][0] - time.monotonic()) if self.line else None
            readable = select.select([self.host_fd, self.switch_fd, 0], [], [], timeout)[0]
            if self.host_fd in readable:
                for frame in self._read(self.host_fd):
                    self._out(frame)
            if self.switch_fd in readable:
                for frame in self._read(self.switch_fd):
                    self.forwarded_in += _write(self.host_fd, frame)
            now = time.monotonic()
            while self.line and self.line[0][0] <= now:
                self.forwarded_out += _write(self.switch_fd, self.line.popleft()[1])
            if 0 in readable:
                data = os.read(0, 4096)
                if not data:
                    return
                *lines, commands = (commands + data).split(b"\n")
                for line in lines:
                    print(self._command(line.decode().split()), flush=True)

    @staticmethod
    def _read(fd: int) -> list[bytes]:
        frames: list[bytes] = []
        try:
            while len(frames) < BURST:
                frames.append(os.read(fd, 65536))
        except BlockingIOError:
            pass
        return frames

    def _out(self, frame: bytes) -> None:
        if self.loss > 0.0 and self.rng.random() < self.loss:
            self.dropped_out += 1
        elif self.delay_s == 0.0 and not self.line:  # the fast path, and no overtaking
            self.forwarded_out += _write(self.switch_fd, frame)
        elif len(self.line) >= QUEUE_LIMIT:
            self.dropped_out += 1
        else:  # never due before the frame ahead of it, even just after the delay shrank
            due = time.monotonic() + self.delay_s
            self.line.append((max(due, self.line[-1][0]) if self.line else due, frame))

    def _command(self, words: list[str]) -> str:
        if words == ["stats"]:
            return f"stats {self.forwarded_out} {self.dropped_out} {self.forwarded_in}"
        if len(words) == 3 and words[0] == "set":
            try:
                delay_ms, loss = float(words[1]), float(words[2])
            except ValueError:
                return f"error not numbers: {' '.join(words)}"
            if not (0.0 <= delay_ms < math.inf and 0.0 <= loss < 1.0):
                return f"error out of range: {' '.join(words)}"
            self.delay_s, self.loss = delay_ms / 1000.0, loss
            return "ok"
        return f"error unknown command: {' '.join(words)}"


def _write(fd: int, frame: bytes) -> int:
    """1 if the frame went out; a device that is down refuses it (EIO), as an unplugged port."""
    try:
        os.write(fd, frame)
    except OSError:
        return 0
    return 1


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--host-netns", "--host-dev", "--switch-netns", "--switch-dev"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for signum in (signal.SIGTERM, signal.SIGINT):  # a clean end: fds closed, devices gone
        signal.signal(signum, _stop)
    fds: list[int] = []
    try:
        tag = f"shp{os.getpid()}"  # <= 11 characters: unique in the root namespace
        fds.append(_open_tap(tag + "h", args.host_netns, args.host_dev, args.mtu))
        fds.append(_open_tap(tag + "s", args.switch_netns, args.switch_dev, args.mtu))
        _ip("-n", args.switch_netns, "link", "set", "dev", args.switch_dev, "up")
        print("ready", flush=True)
        _Relay(fds[0], fds[1], args.seed).run()
    except (RuntimeError, OSError) as error:
        print(f"shaper: {error}", file=sys.stderr)
        return 1
    finally:
        for fd in fds:
            os.close(fd)
    return 0


class ShapedLink:
    """A host's cable as a userspace relay (see the module): delay and loss on its egress.

    ``host_dev`` appears in ``host_netns`` down and without an address, for the caller to
    configure; ``switch_dev`` appears in ``switch_netns`` up, for the caller to attach to its
    bridge. Both go away with :meth:`close` (or the caller's death: the relay reads EOF).
    """

    def __init__(
        self,
        host_netns: str,
        host_dev: str,
        switch_netns: str,
        switch_dev: str,
        *,
        mtu: int = 1500,
        seed: int = 0,
        python: str = sys.executable,
    ) -> None:
        self._closed = False
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the relay's lifetime)
        here = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        command = [python, "-m", "asyncrl.testbed.shaper", "--mtu", str(mtu), "--seed", str(seed)]
        command += ["--host-netns", host_netns, "--host-dev", host_dev]
        command += ["--switch-netns", switch_netns, "--switch-dev", switch_dev]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, here))},
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()
        if self._reply(10.0) != "ready":
            self._stop(grace_s=0.0)
            errors = self._errors()
            self._stderr.close()
            raise RuntimeError(f"the shaper relay did not start: {errors}")

    def set(self, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Delay and drop the host's frames from now on (frames already delayed keep theirs)."""
        if not 0.0 <= delay_ms < math.inf:
            raise ValueError(f"delay_ms must be finite and >= 0, not {delay_ms!r}")
        if not 0.0 <= loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), not {loss!r}")
        self._request(f"set {float(delay_ms)!r} {float(loss)!r}", "ok")

    def stats(self) -> tuple[int, int, int]:
        """(frames forwarded out of the host, dropped out of it, forwarded into it)."""
        out, dropped, into = self._request("stats", "stats").split()[1:]
        return int(out), int(dropped), int(into)

    def close(self) -> None:
        """End the relay (EOF on its stdin), killing it by pid if it lingers; idempotent."""
        if not self._closed:
            self._stop(grace_s=5.0)
            self._stderr.close()

    def _stop(self, grace_s: float) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()  # by its pid, which wait() has not yet released
            self._process.wait()

    def __enter__(self) -> ShapedLink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _read_lines(self) -> None:
        for line in self._stdout:
            self._lines.put(line.strip())
        self._lines.put(None)  # EOF: the relay has ended
        self._stdout.close()

    def _reply(self, timeout: float) -> str | None:
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def _request(self, line: str, answer: str) -> str:
        if self._closed:
            raise RuntimeError("the shaped link is closed")
        try:
            self._stdin.write(line + "\n")
            self._stdin.flush()
        except OSError as error:
            raise RuntimeError(f"the shaper relay is gone: {self._errors()}") from error
        reply = self._reply(5.0)
        if reply is None or reply.split()[:1] != [answer]:
            raise RuntimeError(f"the shaper relay answered {reply!r} to {line!r}: {self._errors()}")
        return reply

    def _errors(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().strip() or "(no stderr)"


if __name__ == "__main__":
    sys.exit(main())
