"""Disks for the faults: a small tmpfs kept full to the last page, a read-only mount, a
mount turned read-only mid-run. They need root; without it :class:`MountUnavailable`
says why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path


class MountUnavailable(Exception):
    """A tmpfs or bind mount could not be made (not root, or no mount namespace rights)."""


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise MountUnavailable(f"mount {' '.join(args)}: {result.stderr.strip()}")


def _umount(path: Path) -> None:
    """Unmount; lazily when a process still holds a file there (it is then detached)."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def can_mount() -> str | None:
    """None when this process may mount (root); else why not, for a skip reason."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (CI and the dev machine run as root)"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MiB at ``path``, unmounted on the way out."""
    if (why := can_mount()) is not None:
        raise MountUnavailable(why)
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only_disk(path: Path) -> Iterator[Path]:
    """An empty read-only tmpfs at ``path`` (unwritable even for root)."""
    if (why := can_mount()) is not None:
        raise MountUnavailable(why)
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


REMOUNT_TRIES = 400
"""Linux refuses a read-only remount ("mount point is busy") while a file under it is open
for writing; aim closes its files between writes, so the remount is tried again (every
50 ms, for 20 s: on a busy machine aim's writes can keep a file open for seconds)."""


def _remount_read_only(path: Path) -> None:
    for _ in range(REMOUNT_TRIES - 1):
        with contextlib.suppress(MountUnavailable):
            return _mount("-o", "remount,bind,ro", str(path))
        time.sleep(0.05)
    _mount("-o", "remount,bind,ro", str(path))


@contextlib.contextmanager
def made_read_only(path: Path) -> Iterator[Callable[[], None]]:
    """Yields a function that turns the directory ``path`` read-only where it is (a bind
    mount of itself, remounted ``ro``), as a filesystem that fails under a running
    process would; unmounted on the way out."""
    mounted = False

    def make() -> None:
        nonlocal mounted
        if (why := can_mount()) is not None:
            raise MountUnavailable(why)
        _mount("--bind", str(path), str(path))
        mounted = True
        _remount_read_only(path)

    try:
        yield make
    finally:
        if mounted:
            _umount(path)


class Filler:
    """Takes every free byte of a filesystem and, until stopped, every byte freed later,
    as another process filling the disk would (a disk that stays full, not one that a
    deleted file makes room on again). Its file is removed on the way out."""

    def __init__(self, directory: Path):
        self.path = directory / "filler"
        self.written = 0
        self.full = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, daemon=True)

    def __enter__(self) -> Filler:
        self.thread.start()
        assert self.full.wait(timeout=60), "the disk never filled"
        return self

    def __exit__(self, *_) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.path.unlink(missing_ok=True)

    def _fill(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while not self.stopping.is_set():
                self._write_until_full(fd)
                self.full.set()
                self.stopping.wait(0.02)
        finally:
            os.close(fd)

    def _write_until_full(self, fd: int) -> None:
        for size in (1 << 20, 1 << 12):  # a tmpfs page last: the last one free is taken too
            block = b"\0" * size
            try:
                while True:
                    self.written += os.write(fd, block)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise


@contextlib.contextmanager
def maybe_small_disk(path: Path, size_mb: int) -> Iterator[str | None]:
    """A tmpfs at ``path`` (None) or, where none can be mounted, a plain directory (why)."""
    with contextlib.ExitStack() as stack:
        why = None
        try:
            stack.enter_context(small_disk(path, size_mb))
        except MountUnavailable as error:
            path.mkdir(parents=True, exist_ok=True)
            why = str(error)
        yield why


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[Path]:
    """A directory this process cannot write in: a read-only tmpfs as root, mode 0500 else."""
    if os.geteuid() != 0:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    with read_only_disk(path):
        yield path
