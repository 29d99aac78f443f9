"""The Python sandbox stops runaway code: time, memory, network, output, files.

Each network test asserts the call FAILS whichever layer applied (a network
namespace, the audit hook, or both); ``layers`` says which did.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrl.envs.sandbox import Sandbox
from asyncrl.envs.tools import format_sandbox_output

FAST = {"timeout_s": 1.5, "memory_mb": 256}


def test_normal_code_returns_its_output():
    result = Sandbox(**FAST).run(
        "import sys\nprint(sum(range(10)))\nprint('note', file=sys.stderr)"
    )
    assert result.ok and result.returncode == 0
    assert (result.stdout, result.stderr) == ("45\n", "note\n")
    assert not result.timed_out and not result.truncated
    assert "rlimits" in result.layers
    assert {"netns", "userns+netns", "audit"} & set(result.layers)


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


@pytest.mark.parametrize("network", ["auto", "namespace", "audit"])
def test_network_calls_fail(listener, network):
    port = listener.getsockname()[1]
    result = Sandbox(timeout_s=5, memory_mb=256, network=network).run(
        NETWORK_PROBE.format(port=port)
    )
    assert result.ok, result.stderr
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.count("BLOCKED") == 5, result.stdout
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever reached the test's port
    namespace = {"netns", "userns+netns"} & set(result.layers)
    if network == "audit":
        assert "audit" in result.layers and not namespace
    elif network == "namespace":
        # The namespace alone, or the audit hook as the fallback where none can be made.
        assert bool(namespace) != ("audit" in result.layers), result.notes
    else:
        assert "audit" in result.layers


def test_it_cannot_raise_its_own_limits():
    result = Sandbox(**FAST, network="namespace").run(
        "import resource\n"
        "try:\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n"
        "    print('RAISED')\n"
        "except (ValueError, OSError) as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    assert result.stdout.startswith("REFUSED"), (result.stdout, result.layers)


def test_scratch_directory_is_the_cwd_and_is_removed(monkeypatch):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2")
    result = Sandbox(**FAST).run(
        "import os\n"
        "open('notes.txt', 'w').write('hi')\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "print(os.environ.get('HOME'), sorted(os.environ))\n"
    )
    assert result.ok, result.stderr
    cwd, listing, env = result.stdout.splitlines()
    assert os.path.basename(cwd).startswith("asyncrl-sandbox-")
    assert os.path.dirname(cwd) == tempfile.gettempdir()
    assert listing == "['main.py', 'notes.txt']"
    assert env.startswith(cwd + " ") and "ASYNCRL_TEST_SECRET" not in env
    assert not os.path.exists(cwd)


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
    with pytest.raises(ValueError):
        Sandbox(network="off")


def test_without_a_network_namespace_the_audit_hook_takes_over(listener, monkeypatch):
    from asyncrl.envs import sandbox

    monkeypatch.setattr(sandbox, "NAMESPACE_ATTEMPTS", [("netns", -1)])  # EINVAL
    port = listener.getsockname()[1]
    result = Sandbox(timeout_s=5, memory_mb=256, network="namespace").run(
        NETWORK_PROBE.format(port=port)
    )
    assert "audit" in result.layers and "netns" not in result.layers
    assert result.notes and "unshare failed" in result.notes[0]
    assert "CONNECTED" not in result.stdout and result.stdout.count("BLOCKED") == 5
