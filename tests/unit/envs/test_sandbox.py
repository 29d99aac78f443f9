"""The Python sandbox stops runaway code: time, memory, network, output, files.

It runs under bubblewrap (``layers`` says what applied); when bubblewrap cannot
be used the code is not run at all. The attacks it stops are in
``test_sandbox_escapes.py``.
"""

from __future__ import annotations

import ast
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrl.generation.envs.sandbox import Sandbox, SandboxUnavailable, check_isolation
from asyncrl.generation.envs.sandbox import interpreter as sandbox_interpreter
from asyncrl.generation.envs.tools import format_sandbox_output

FAST = {"timeout_s": 1.5, "memory_mb": 256}
BUBBLEWRAP_LAYERS = {"bubblewrap", "user", "pid", "net", "mount", "seccomp", "rlimits"}

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
    ),
    pytest.mark.usefixtures("bubblewrap"),
]


def test_normal_code_returns_its_output():
    result = Sandbox(**FAST).run(
        "import sys\nprint(sum(range(10)))\nprint('note', file=sys.stderr)"
    )
    assert result.ok and result.returncode == 0
    assert (result.stdout, result.stderr) == ("45\n", "note\n")
    assert not result.timed_out and not result.truncated
    assert set(result.layers) >= BUBBLEWRAP_LAYERS, result.layers
    assert ("separate-user" in result.layers) == (os.geteuid() == 0)


def test_an_exception_is_a_traceback_of_the_users_code_only():
    result = Sandbox(**FAST).run("x = 1\nraise ValueError('bad value')\n")
    assert result.returncode == 1 and not result.ok
    assert 'File "main.py", line 2' in result.stderr
    assert "ValueError: bad value" in result.stderr
    assert "<string>" not in result.stderr  # no prelude frames
    assert Sandbox(**FAST).run("import sys; sys.exit(3)").returncode == 3
    syntax = Sandbox(**FAST).run("x = (1,\n")
    assert syntax.returncode == 1 and 'File "main.py", line 1' in syntax.stderr
    assert "SyntaxError" in syntax.stderr and "<string>" not in syntax.stderr


def test_an_infinite_loop_is_stopped_by_the_time_limit():
    start = time.monotonic()
    result = Sandbox(timeout_s=1, memory_mb=256).run("while True:\n    pass\n")
    assert result.timed_out and result.returncode is not None and result.returncode < 0
    assert time.monotonic() - start < 4
    assert "time limit of 1s" in format_sandbox_output(result, 1)


def test_code_that_closes_its_output_and_sleeps_is_still_stopped():
    start = time.monotonic()
    result = Sandbox(timeout_s=1, memory_mb=256).run(
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(30)\n"
    )
    assert result.timed_out and time.monotonic() - start < 4


@pytest.mark.parametrize(
    "code",
    [
        "hog = bytearray(2 * 1024 ** 3)\n",
        "hog = []\nwhile True:\n    hog.append(bytearray(50 * 1024 ** 2))\n",
    ],
    ids=["2GB-at-once", "growing"],
)
def test_a_memory_hog_is_stopped_by_the_memory_limit(code):
    start = time.monotonic()
    result = Sandbox(timeout_s=5, memory_mb=256).run(code)
    assert not result.ok and not result.timed_out
    assert "MemoryError" in result.stderr
    assert time.monotonic() - start < 4


def test_memory_under_the_limit_is_fine():
    result = Sandbox(timeout_s=5, memory_mb=256).run("x = bytearray(64 * 1024 ** 2)\nprint(len(x))")
    assert result.ok and result.stdout == f"{64 * 1024**2}\n"


NETWORK_PROBE = """
import socket
import subprocess
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("CONNECTED", address)
    except OSError as exc:
        print("BLOCKED", address, type(exc).__name__)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("RESOLVED")
except OSError as exc:
    print("BLOCKED dns", type(exc).__name__)
try:
    import subprocess, sys
    child = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    code = subprocess.run([sys.executable, "-c", child], capture_output=True).returncode
    print("CHILD", "BLOCKED" if code else "CONNECTED")
except OSError as exc:
    print("CHILD BLOCKED", type(exc).__name__)
"""


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def test_network_calls_fail(listener):
    port = listener.getsockname()[1]
    result = Sandbox(timeout_s=5, memory_mb=256).run(NETWORK_PROBE.format(port=port))
    assert result.ok, result.stderr
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.count("BLOCKED") == 5, result.stdout
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever reached the test's port
    assert {"net", "seccomp"} <= set(result.layers)


def test_it_cannot_raise_its_own_limits():
    result = Sandbox(**FAST).run(
        "import resource\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n"
        "    print('RAISED')\n"
        "except (ValueError, OSError) as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert result.stdout.startswith("REFUSED"), (result.stdout, result.layers)


def test_seccomp_refuses_what_a_sandbox_never_needs():
    result = Sandbox(**FAST).run(
        "import ctypes, os, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "x86 = os.uname().machine == 'x86_64'\n"
        "calls = {\n"
        "    'unshare': lambda: libc.unshare(0x10000000),\n"
        "    'ptrace': lambda: libc.ptrace(16, 1, 0, 0),\n"  # PTRACE_ATTACH to pid 1
        "    'mount': lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None),\n"
        "    'io_uring_setup': lambda: libc.syscall(425, 1, None),\n"  # x86_64 and arm64
        "    'bpf': lambda: libc.syscall(321 if x86 else 280, 0, 0, 0),\n"
        "    'keyctl': lambda: libc.syscall(250 if x86 else 219, 0),\n"
        "}\n"
        "for name, call in calls.items():\n"
        "    print(name, call(), ctypes.get_errno())\n"
        "for family in ('AF_INET', 'AF_INET6', 'AF_NETLINK', 'AF_PACKET'):\n"
        "    try:\n"
        "        socket.socket(getattr(socket, family), socket.SOCK_DGRAM).close()\n"
        "        print(family, 'OPENED')\n"
        "    except OSError as exc:\n"
        "        print(family, -1, exc.errno)\n"
        "a, b = socket.socketpair()\n"  # AF_UNIX stays
        "a.sendall(b'ok'); print('unix', b.recv(2).decode())\n"
    )
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert lines[-1] == "unix ok"
    for line in lines[:-1]:
        _name, returned, error = line.split()
        assert (returned, error) == ("-1", "1"), line  # EPERM


def test_processes_are_limited():
    result = Sandbox(timeout_s=5, memory_mb=256, max_processes=8).run(
        "import os, time\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(10)\n"
        "            os._exit(0)\n"
        "        started += 1\n"
        "except OSError as exc:\n"
        "    print('REFUSED', exc.errno)\n"
        "print(started)\n"
    )
    assert result.stdout.startswith("REFUSED 11"), result  # EAGAIN
    assert int(result.stdout.split()[-1]) < 8


def test_a_private_tmp_is_the_cwd_and_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")

    def no_host_scratch(*args, **kwargs):
        raise AssertionError("bubblewrap runs need no host scratch directory")

    monkeypatch.setattr(tempfile, "mkdtemp", no_host_scratch)
    result = Sandbox(**FAST).run(
        "import os\n"
        "open('notes.txt', 'w').write('hi')\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print(os.environ.get('HOME'), sorted(os.environ))\n"
        "print(sorted(os.listdir('/')), os.getuid(), os.getgid())\n"
    )
    assert result.ok, result.stderr
    cwd, listing, env, root = result.stdout.splitlines()
    assert cwd == "/tmp"
    assert listing == "['main.py', 'notes.txt']"
    assert env == "/tmp ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"  # PWD: set by bwrap
    entries, ids = root.split("] ")
    assert ids == "65534 65534"
    entries = set(ast.literal_eval(entries + "]"))
    assert {"dev", "etc", "proc", "tmp", "usr"} <= entries
    assert entries <= {
        "bin",
        "sbin",
        "lib",
        "lib64",
        "lib32",
        "libx32",
        "dev",
        "etc",
        "proc",
        "tmp",
        "usr",
    }


def test_output_is_truncated():
    result = Sandbox(**FAST, max_output_bytes=1000).run("print('a' * 100_000)")
    assert result.ok and result.truncated and result.stdout == "a" * 1000
    assert format_sandbox_output(result).endswith("[output truncated]")


def test_an_output_flood_is_cut_and_stopped():
    start = time.monotonic()
    result = Sandbox(timeout_s=1, memory_mb=256, max_output_bytes=5000).run(
        "while True:\n    print('x' * 1000)\n"
    )
    assert result.timed_out and result.truncated and len(result.stdout) == 5000
    assert time.monotonic() - start < 4


def test_files_it_writes_are_size_limited():
    result = Sandbox(**FAST, max_file_mb=1).run(
        "try:\n"
        "    open('big', 'wb').write(b'0' * (8 * 1024 * 1024))\n"
        "    print('WROTE')\n"
        "except OSError as exc:\n"
        "    print('REFUSED', exc.errno)\n"
    )
    assert result.stdout.startswith("REFUSED"), result


def test_runs_in_parallel_threads_are_independent():
    sandbox = Sandbox(**FAST)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run, [f"print({i} * 2)" for i in range(4)]))
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n", "6\n"]


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError):
        Sandbox(timeout_s=0)
    with pytest.raises(ValueError, match="bubblewrap"):
        Sandbox(isolation="off")
    with pytest.raises(ValueError):
        Sandbox(tmp_mb=0)


def test_isolation_none_warns_and_runs_a_plain_subprocess(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.envs.sandbox"):
        sandbox = Sandbox(**FAST, isolation="none")
    assert "ISOLATION IS OFF" in caplog.text and "trusted code only" in caplog.text
    assert sandbox.python == sys.executable
    result = sandbox.run("import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))")
    assert result.ok and result.layers == ("rlimits",), result
    cwd, listing = result.stdout.splitlines()
    assert os.path.basename(cwd).startswith("asyncrl-sandbox-") and listing == "['main.py']"
    assert not os.path.exists(cwd)  # the scratch directory is removed
    memory = sandbox.run("hog = bytearray(2 * 1024 ** 3)\n")
    assert "MemoryError" in memory.stderr  # the rlimits still hold


def test_without_bubblewrap_the_code_is_not_run(tmp_path):
    marker = tmp_path / "ran"
    sandbox = Sandbox(**FAST, bwrap="/nonexistent/bwrap")
    result = sandbox.run(f"open({str(marker)!r}, 'w')")
    assert result.returncode is None and not result.ok and not marker.exists()
    assert "the code was not run" in result.stderr
    assert "apt-get install bubblewrap" in result.stderr
    assert format_sandbox_output(result).endswith("[not run]")
    with pytest.raises(SandboxUnavailable) as caught:
        check_isolation(sandbox)
    message = str(caught.value)
    assert "\n" not in message
    assert "apt-get install bubblewrap" in message and "user namespaces" in message
    assert "Docker" in message


@pytest.fixture
def fake_bwrap():
    """A bwrap that fails its set-up as a kernel without user namespaces makes it."""
    folder = tempfile.mkdtemp(prefix="asyncrl-fake-bwrap-", dir="/var/tmp")
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "bwrap")
    with open(path, "w") as f:
        f.write(
            "#!/bin/sh\n"
            "echo 'bwrap: No permissions to create new namespace, likely because the "
            "kernel does not allow non-privileged user namespaces.' >&2\n"
            "exit 1\n"
        )
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(folder, ignore_errors=True)


def test_a_bubblewrap_set_up_failure_is_not_run_and_says_why(fake_bwrap, caplog):
    sandbox = Sandbox(**FAST, bwrap=fake_bwrap)
    with caplog.at_level(logging.ERROR, logger="asyncrl.envs.sandbox"):
        result = sandbox.run("print(1)")
    assert result.returncode is None and result.stdout == ""
    assert "could not set up the sandbox: bwrap: No permissions" in result.stderr
    with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
        check_isolation(sandbox)


def test_check_isolation_passes_where_bubblewrap_works():
    check_isolation()
    check_isolation(Sandbox(**FAST))
    check_isolation(Sandbox(**FAST, isolation="none"))  # nothing to check


def test_the_sandbox_interpreter_is_one_the_sandbox_user_can_reach(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python").write_text("")
    (private / "python").chmod(0o755)
    if os.geteuid() == 0:
        assert not sandbox_interpreter._can_reach(str(private / "python"), 65534, 65534, os.X_OK)
    assert sandbox_interpreter._can_reach("/usr/bin/env", 65534, 65534, os.X_OK)
    python = Sandbox().python
    uid, gid = (65534, 65534) if os.geteuid() == 0 else (None, None)
    assert sandbox_interpreter._can_reach(python, uid, gid, os.R_OK | os.X_OK)
    assert python in (os.path.realpath(sys.executable), sandbox_interpreter.FALLBACK_PYTHON)
    result = Sandbox(**FAST).run("import sys\nprint(sys.executable, sys.flags.isolated)")
    assert result.stdout == f"{python} 1\n", result


def test_check_isolation_where_namespaces_are_denied():
    from tests.helpers.sandbox import DENY_NAMESPACES

    check = (
        "from asyncrl.generation.envs.sandbox import SandboxUnavailable, check_isolation\n"
        "try:\n"
        "    check_isolation()\n"
        "    print('PASSED')\n"
        "except SandboxUnavailable as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    host = subprocess.run(
        [sys.executable, "-c", DENY_NAMESPACES + check], capture_output=True, text=True, timeout=60
    )
    assert host.stdout.startswith("REFUSED"), (host.stdout, host.stderr)
    assert host.stdout.count("\n") == 1  # one line
    assert "bwrap: No permissions to create new namespace" in host.stdout
    assert "apt-get install bubblewrap" in host.stdout and "Docker" in host.stdout
