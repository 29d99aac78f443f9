"""Escapes from the python tool's sandbox, each written as the attacker's code.

Every test here is an attack that worked against the sandbox before it ran
code under bubblewrap (a subprocess of the generator's own user with an audit
hook): the model's code is run through ``Sandbox().run(...)`` and the test
asserts the attack failed, checking from the host where it can (files
unchanged, nothing connected, the process still alive, nothing left running).

Host-side targets live in a world-readable, world-writable folder outside
``/tmp`` (``world_dir``), so that only the sandbox's walls, not file
permissions, keep the code out.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.generation.envs.sandbox import Sandbox
from tests.helpers.sandbox import DENY_NAMESPACES

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
    ),
    pytest.mark.usefixtures("bubblewrap"),
]

LIMITS = {"timeout_s": 10, "memory_mb": 256}
"""Only arguments the pre-bubblewrap Sandbox took as well."""


def run(code: str, **limits) -> object:
    return Sandbox(**{**LIMITS, **limits}).run(code)


# -- host-side targets ---------------------------------------------------------


@pytest.fixture
def world_dir():
    """A folder anyone may read and write, outside /tmp."""
    base = "/var/tmp" if os.path.isdir("/var/tmp") else None
    path = Path(tempfile.mkdtemp(prefix="asyncrl-escape-", dir=base))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_dir(world_dir):
    """A fake run directory: secret keys and config.yaml, readable and writable by all."""
    run = world_dir / "run"
    (run / "keys").mkdir(parents=True)
    for folder in (run, run / "keys"):
        folder.chmod(0o777)
    secret = run / "keys" / "server.key_secret"
    secret.write_text("SECRET-KEY-MATERIAL\n")
    config = run / "config.yaml"
    config.write_text("reward:\n  function: null\n")
    for file in (secret, config):
        file.chmod(0o666)
    return run


@pytest.fixture
def unix_listener(world_dir):
    path = world_dir / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    path.chmod(0o777)
    server.listen()
    server.setblocking(False)
    yield server, str(path)
    server.close()


@pytest.fixture
def tcp_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server, server.getsockname()[1]
    server.close()


def nothing_connected(server: socket.socket) -> bool:
    try:
        connection, _ = server.accept()
    except BlockingIOError:
        return True
    connection.close()
    return False


# What the attacker tries once past a wall; also run as a script by child processes.
ATTEMPTS = r"""
import os, socket

def read(path):
    try:
        with open(path, "rb") as f:
            return "READ " + f.read(64).decode("utf-8", "replace").strip()
    except Exception as exc:
        return "DENIED " + type(exc).__name__

def connect(family, address):
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect(address)
        s.close()
        return "CONNECTED"
    except Exception as exc:
        return "DENIED " + type(exc).__name__

def attempts(secret, unix_path, port):
    return [
        "secret: " + read(secret),
        "unix: " + connect(socket.AF_UNIX, unix_path),
        "tcp: " + connect(socket.AF_INET, ("127.0.0.1", port)),
    ]
"""


def attempts_call(secret: Path, unix_path: str, port: int) -> str:
    return f"attempts({str(secret)!r}, {unix_path!r}, {port})"


def assert_all_denied(result, secret_text: str, *servers: socket.socket) -> None:
    assert secret_text not in result.stdout, result
    assert "READ" not in result.stdout and "CONNECTED" not in result.stdout, result
    for server in servers:
        assert nothing_connected(server), result


# -- files ------------------------------------------------------------------------


def test_etc_shadow_is_not_readable():
    result = run(
        "for path in ['/etc/shadow', '/etc/passwd', '/etc/hostname']:\n"
        "    try:\n"
        "        print(path, 'READ', len(open(path).read()))\n"
        "    except OSError as exc:\n"
        "        print(path, 'DENIED', type(exc).__name__)\n"
    )
    assert "/etc/shadow DENIED" in result.stdout, result
    assert "READ" not in result.stdout, result


def test_run_dir_secret_keys_are_not_readable(run_dir):
    secret = run_dir / "keys" / "server.key_secret"
    result = run(
        "import os\n"
        f"for path in [{str(secret)!r}, {str(run_dir / 'config.yaml')!r}]:\n"
        "    try:\n"
        "        print('READ', open(path).read())\n"
        "    except OSError as exc:\n"
        "        print('DENIED', type(exc).__name__)\n"
        "try:\n"
        f"    print('LISTED', os.listdir({str(run_dir)!r}))\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
    )
    assert "SECRET-KEY-MATERIAL" not in result.stdout, result
    assert "READ" not in result.stdout and "LISTED" not in result.stdout, result
    assert result.stdout.count("DENIED") == 3, result


def test_home_directory_files_are_not_readable(world_dir):
    fake_home = world_dir / "home"
    fake_home.mkdir(mode=0o755)
    netrc = fake_home / ".netrc"
    netrc.write_text("machine example.com login me password HOME-SECRET\n")
    netrc.chmod(0o644)
    home = str(Path.home())
    result = run(
        "import os\n"
        f"for path in [{str(netrc)!r}, os.path.join({home!r}, '.bashrc')]:\n"
        "    try:\n"
        "        print('READ', open(path).read()[:40])\n"
        "    except OSError as exc:\n"
        "        print('DENIED', type(exc).__name__)\n"
        f"for folder in [{home!r}, {str(fake_home)!r}]:\n"
        "    try:\n"
        "        print('LISTED', os.listdir(folder))\n"
        "    except OSError as exc:\n"
        "        print('DENIED', type(exc).__name__)\n"
    )
    assert "HOME-SECRET" not in result.stdout, result
    assert "READ" not in result.stdout and "LISTED" not in result.stdout, result
    assert result.stdout.count("DENIED") == 4, result


def test_the_interpreters_site_packages_are_hidden_and_read_only():
    # Listing only: the attack, a .pth file written there, would change this
    # machine's interpreter if it worked, so the test checks that it could not.
    result = run(
        "import os, sysconfig\n"
        "for key in ('purelib', 'platlib'):\n"
        "    path = sysconfig.get_paths()[key]\n"
        "    listing = os.listdir(path) if os.path.isdir(path) else []\n"
        "    print(key, len(listing), 'WRITABLE' if os.access(path, os.W_OK) else 'read-only')\n"
    )
    assert result.ok, result
    for line in result.stdout.splitlines():
        _key, count, access = line.split()
        assert (count, access) == ("0", "read-only"), result.stdout


def test_writing_a_pth_file_into_site_packages_fails(world_dir):
    site_packages = world_dir / "lib" / "python3.11" / "site-packages"
    site_packages.mkdir(parents=True)
    for folder in (world_dir / "lib", site_packages.parent, site_packages):
        folder.chmod(0o777)
    target = site_packages / "zzz_evil.pth"
    result = run(
        "try:\n"
        f"    with open({str(target)!r}, 'w') as f:\n"
        "        f.write('import os; os.system(\"id > /tmp/pwned\")\\n')\n"
        "    print('WROTE')\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
    )
    assert not target.exists(), result
    assert list(site_packages.iterdir()) == []
    assert "DENIED" in result.stdout, result


def test_the_run_config_cannot_be_changed(run_dir):
    config = run_dir / "config.yaml"
    before = config.read_bytes()
    result = run(
        "import os\n"
        "try:\n"
        f"    with open({str(config)!r}, 'a') as f:\n"
        "        f.write('reward:\\n  function: /tmp/evil.py:f\\n')\n"
        "    print('WROTE')\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
        "try:\n"
        f"    os.replace('main.py', {str(run_dir / 'planted.yaml')!r})\n"
        "    print('PLANTED')\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
    )
    assert config.read_bytes() == before, result
    assert not (run_dir / "planted.yaml").exists(), result
    assert result.stdout.count("DENIED") == 2, result


# -- around the old audit hook ------------------------------------------------------


def test_fork_exec_without_an_audit_event_reaches_nothing(run_dir, unix_listener, tcp_listener):
    secret = run_dir / "keys" / "server.key_secret"
    child = (
        ATTEMPTS + f"print(*{attempts_call(secret, unix_listener[1], tcp_listener[1])}, sep='\\n')"
    )
    result = run(
        "import _posixsubprocess, os, subprocess, sys\n"
        f"child = {child!r}\n"
        "errpipe_read, errpipe_write = os.pipe()\n"
        "exe = sys.executable\n"
        "pid = _posixsubprocess.fork_exec(\n"
        "    [exe, '-c', child], [exe.encode()], True, (), None, None,\n"
        "    -1, -1, -1, -1, -1, -1, errpipe_read, errpipe_write,\n"
        "    False, False, -1, None, None, None, -1, None, subprocess._USE_VFORK)\n"
        "os.close(errpipe_write)\n"
        "print('started', pid > 0, flush=True)\n"
        "os.waitpid(pid, 0)\n"
    )
    assert "started True" in result.stdout, result  # the bypass itself still works...
    assert_all_denied(result, "SECRET-KEY-MATERIAL", unix_listener[0], tcp_listener[0])
    assert result.stdout.count("DENIED") == 3, result  # ...and reaches nothing


def test_multiprocessing_spawn_reaches_nothing(run_dir, unix_listener, tcp_listener):
    secret = run_dir / "keys" / "server.key_secret"
    result = run(
        ATTEMPTS + "import multiprocessing\n"
        "def attack():\n"
        f"    print(*{attempts_call(secret, unix_listener[1], tcp_listener[1])}, sep='\\n',"
        " flush=True)\n"
        "if __name__ == '__main__':\n"
        "    process = multiprocessing.get_context('spawn').Process(target=attack)\n"
        "    process.start()\n"
        "    process.join(8)\n"
        "    print('child exit', process.exitcode)\n"
    )
    assert "child exit 0" in result.stdout, result
    assert_all_denied(result, "SECRET-KEY-MATERIAL", unix_listener[0], tcp_listener[0])
    assert result.stdout.count("DENIED") == 3, result


HOOK_BYPASS = """
import sys
frame = sys._getframe()
while frame is not None:  # the frames above hold the old audit hook: make it a no-op
    for value in list(frame.f_locals.values()):
        if callable(value) and getattr(value, "__name__", "") == "hook":
            value.__code__ = (lambda event, args: None).__code__
            print("hook replaced")
    frame = frame.f_back
"""


def test_replacing_the_hooks_code_reaches_nothing(run_dir, unix_listener, tcp_listener):
    secret = run_dir / "keys" / "server.key_secret"
    result = run(
        ATTEMPTS
        + HOOK_BYPASS
        + f"print(*{attempts_call(secret, unix_listener[1], tcp_listener[1])}, sep='\\n')\n"
    )
    assert result.ok, result
    assert_all_denied(result, "SECRET-KEY-MATERIAL", unix_listener[0], tcp_listener[0])
    assert result.stdout.count("DENIED") == 3, result


# -- processes --------------------------------------------------------------------

HOST_CALL = """
import json, sys
from asyncrl.generation.envs.sandbox import Sandbox
result = Sandbox(timeout_s=10, memory_mb=256).run(sys.argv[1])
print("ALIVE", json.dumps([result.returncode, result.stdout, result.stderr]))
"""


def test_it_cannot_kill_its_parent():
    # The "generator" is a disposable host process here, in case the attack works.
    code = (
        "import os, signal, time\n"
        "parent = os.getppid()\n"
        "try:\n"
        "    os.kill(parent, signal.SIGKILL)\n"
        "    print('SIGNALLED', parent)\n"
        "except OSError as exc:\n"
        "    print('DENIED', type(exc).__name__)\n"
        "time.sleep(0.5)\n"
    )
    host = subprocess.run(
        [sys.executable, "-c", HOST_CALL, code], capture_output=True, text=True, timeout=60
    )
    assert host.returncode == 0, (host.returncode, host.stdout, host.stderr)
    assert host.stdout.startswith("ALIVE"), host


def test_it_cannot_signal_host_processes():
    # A process of this (the generator's) user, the attack's target.
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = run(
            "import os, signal\n"
            f"for pid in [{victim.pid}, -{victim.pid}]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print('SIGNALLED', pid)\n"
            "    except OSError as exc:\n"
            "        print('DENIED', type(exc).__name__)\n"
        )
        time.sleep(0.2)
        assert victim.poll() is None, result
        assert "SIGNALLED" not in result.stdout, result
    finally:
        victim.kill()
        victim.wait()


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_no_process_outlives_the_call():
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    loop = "import time\nwhile True:\n    time.sleep(0.2)\n"
    code = (
        "import _posixsubprocess, os, subprocess, sys\n"
        "exe = sys.executable\n"
        f"args = [exe, '-c', {loop!r}, {marker!r}]\n"
        "try:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        os.execv(exe, args)\n"
        "    print('forked')\n"
        "except PermissionError:\n"  # the old audit hook: around it
        "    r, w = os.pipe()\n"
        "    _posixsubprocess.fork_exec(args, [exe.encode()], True, (), None, None,\n"
        "        -1, -1, -1, -1, -1, -1, r, w, False, True, -1, None, None, None, -1,\n"
        "        None, subprocess._USE_VFORK)\n"
        "    print('fork_exec')\n"
    )
    try:
        result = Sandbox(timeout_s=3, memory_mb=256).run(code)
        assert "fork" in result.stdout, result
        deadline = time.monotonic() + 2
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker) == [], "a process of the sandbox is still running"
    finally:
        for pid in _processes_with(marker):  # what the attack left, found by its marker
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# -- disk ---------------------------------------------------------------------------

FILL = """
import os
written, error = 0, None
chunk = b"x" * (4 * 1024 * 1024)
try:
    for i in range(25):  # 100 MB in files under the per-file limit
        with open(os.path.join({folder!r}, "asyncrl-fill-{marker}-%d" % i), "wb") as f:
            f.write(chunk)
        written += len(chunk)
except OSError as exc:
    error = exc.errno
print(written, error)
"""


@pytest.mark.parametrize(("folder", "limit_mb"), [(".", 64), ("/dev/shm", 16)])
def test_disk_and_shared_memory_are_size_limited(folder, limit_mb):
    marker = uuid.uuid4().hex
    try:
        result = run(FILL.format(folder=folder, marker=marker))
        assert result.ok, result
        written, error = result.stdout.split()
        assert int(written) <= limit_mb * 1024 * 1024, result.stdout
        assert error == str(errno.ENOSPC), result.stdout
    finally:
        if os.path.isdir("/dev/shm"):  # what a sandbox without its own /dev/shm leaves
            for name in os.listdir("/dev/shm"):
                if marker in name:
                    os.unlink(os.path.join("/dev/shm", name))


def test_concurrent_runs_cannot_see_each_others_files():
    victim = (
        "import os, time\n"
        "open('mine.txt', 'w').write('victim')\n"
        "time.sleep(2.5)\n"
        "print(sorted(os.listdir('.')))\n"
    )
    attacker = (
        "import glob, os, time\n"
        "time.sleep(1.0)\n"
        "here = os.path.realpath(os.getcwd())\n"
        "candidates = glob.glob('/tmp/*') + glob.glob(os.path.dirname(here) + '/*')\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        candidates.append('/proc/%s/cwd' % pid)\n"
        "hits = []\n"
        "for folder in candidates:\n"
        "    try:\n"
        "        if os.path.realpath(folder) == here or 'mine.txt' not in os.listdir(folder):\n"
        "            continue\n"
        "        open(os.path.join(folder, 'planted.txt'), 'w').write('attacker')\n"
        "        hits.append(folder)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('HITS', hits)\n"
    )
    results: dict[str, object] = {}

    def call(name: str, code: str) -> None:
        results[name] = run(code)

    threads = [
        threading.Thread(target=call, args=("victim", victim)),
        threading.Thread(target=call, args=("attacker", attacker)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results["victim"].stdout == "['main.py', 'mine.txt']\n", results
    assert results["attacker"].stdout == "HITS []\n", results


# -- network --------------------------------------------------------------------------


def test_localhost_tcp_and_a_host_unix_socket_are_unreachable(unix_listener, tcp_listener):
    unix_path, port = unix_listener[1], tcp_listener[1]
    result = run(
        ATTEMPTS + HOOK_BYPASS + f"print(*{attempts_call(Path('/nonexistent'), unix_path, port)},"
        " sep='\\n')\n"
    )
    assert result.ok, result
    assert "CONNECTED" not in result.stdout, result
    assert nothing_connected(unix_listener[0]) and nothing_connected(tcp_listener[0])


def test_where_namespaces_are_denied_the_code_does_not_run(run_dir, unix_listener, tcp_listener):
    secret = run_dir / "keys" / "server.key_secret"
    child = (
        ATTEMPTS + f"print(*{attempts_call(secret, unix_listener[1], tcp_listener[1])}, sep='\\n')"
    )
    code = (
        "import _posixsubprocess, os, subprocess, sys\n"
        f"child = {child!r}\n"
        "r, w = os.pipe()\n"
        "exe = sys.executable\n"
        "pid = _posixsubprocess.fork_exec([exe, '-c', child], [exe.encode()],\n"
        "    True, (), None, None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None,\n"
        "    None, -1, None, subprocess._USE_VFORK)\n"
        "os.waitpid(pid, 0)\n"
    )
    host = subprocess.run(
        [sys.executable, "-c", DENY_NAMESPACES + HOST_CALL, code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert host.stdout.startswith("ALIVE"), (host.stdout, host.stderr)
    returncode, stdout, stderr = json.loads(host.stdout.split(" ", 1)[1])
    assert "CONNECTED" not in stdout and "READ" not in stdout, stdout
    assert nothing_connected(unix_listener[0]) and nothing_connected(tcp_listener[0])
    assert returncode is None and "the code was not run" in stderr, (returncode, stdout, stderr)
