"""A real BufferService on its own event loop in a background thread, for tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import uvloop

from asyncrl.buffer.main import build_store
from asyncrl.buffer.service import BufferService
from asyncrl.buffer.store import BufferStore
from asyncrl.config import Config
from asyncrl.core.transport import tcp
from asyncrl.generation.tasks import work_item_factory


class RunningBuffer:
    """A BufferService on its own event loop in a background thread."""

    def __init__(self, config: Config):
        self.config = config
        self.endpoint = tcp("127.0.0.1", config.cluster.buffer_port)
        self.service: BufferService | None = None
        self.store: BufferStore | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="buffer-service", daemon=True)

    def _run(self) -> None:
        # The service, its zmq context and its socket are created on the thread that uses them.
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.store = build_store(self.config, work_item_factory(self.config))
            self.service = BufferService(self.config, self.store, self.endpoint)
            self.started.set()
            self.loop.run_until_complete(self.service.serve_loop())
        except BaseException as error:  # recorded for the test; the thread must end cleanly
            self.error = error
        finally:
            self.started.set()
            if self.service is not None and not self.service.socket.closed:
                self.service.socket.close(linger=0)
                self.service.context.term()
            self.loop.close()

    def start(self) -> RunningBuffer:
        self.thread.start()
        assert self.started.wait(30), "buffer service did not start"
        assert self.service is not None, f"buffer service failed to start: {self.error!r}"
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            # RuntimeError: the loop already ended (the service crashed).
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.service.stopping.set)
        self.thread.join(10)
        assert not self.thread.is_alive(), "buffer service did not stop"


@contextlib.contextmanager
def running_buffer(config: Config) -> Iterator[RunningBuffer]:
    """A started RunningBuffer, stopped on the way out; the service must not have failed."""
    running = RunningBuffer(config).start()
    try:
        yield running
    finally:
        running.stop()
    assert running.error is None, running.error
