"""Every process of a sandboxed call is inside its limits, and none outlives the call.

Attacks of issue 27 (S1-S4), each written as the attacker's code and run through
``Sandbox().run``: the sandbox's PID 1 taken over through ``/proc/1/mem``; a
payload that clears its parent-death signal and leaves its session; 400 MB
written to the sandbox's root; 21 forked processes of 64 MB each. Each failed
against the sandbox before its PID 1 was its own, its root read-only and its
calls in cgroups; the docstrings say what the attack did then.

The limits that need a cgroup are skipped (with the reason) where this machine
gives none; the others hold in every mode, ``cgroup="off"`` included.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from asyncrl.generation.envs.sandbox import Sandbox, check_isolation
from asyncrl.generation.envs.sandbox import cgroup_detect as sandbox_cgroups
from asyncrl.generation.envs.sandbox.cgroup_detect import CgroupSupport
from asyncrl.generation.envs.sandbox.cgroups import CallLimits, CgroupV1Call, CgroupV2Call

REPO = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
    ),
    pytest.mark.usefixtures("bubblewrap"),
]


def whole_call_limits() -> CgroupSupport:
    support = sandbox_cgroups.cgroup_support()
    if support.mode == "none":
        pytest.skip(f"this machine gives the sandbox no cgroup: {support.reason}")
    return support


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:  # what an attack left, found by its marker
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# -- S1: PID 1 is out of the code's reach and inside the limits ------------------------

PROC_1 = """
import os
for path, mode in (("/proc/1/syscall", os.O_RDONLY), ("/proc/1/mem", os.O_RDWR)):
    try:
        os.close(os.open(path, mode))
        print(path, "OPENED")
    except OSError as exc:
        print(path, "DENIED", type(exc).__name__)
"""


@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_the_code_cannot_read_pid_1s_registers_or_open_its_memory(cgroup):
    """S1: bwrap's init ran as the code's uid and was dumpable: both opened, and
    an ``execve`` written at its program counter ran as PID 1."""
    result = Sandbox(timeout_s=10, memory_mb=256, cgroup=cgroup).run(PROC_1)
    assert result.ok, result
    assert result.stdout == (
        "/proc/1/syscall DENIED PermissionError\n/proc/1/mem DENIED PermissionError\n"
    ), result
    assert "init" in result.layers


def test_pid_1_runs_under_the_calls_rlimits():
    """S1: bwrap's init had no address-space, file-size or process limit."""
    result = Sandbox(timeout_s=10, memory_mb=256, max_file_mb=8, max_processes=32).run(
        "print(open('/proc/1/limits').read())"
    )
    assert result.ok, result
    limits = {}
    for line in result.stdout.splitlines()[1:]:
        if line.strip():
            name, soft = line[:26].strip(), line[26:47].strip()
            limits[name] = soft
    assert limits["Max address space"] == str(256 * 1024 * 1024), result.stdout
    assert limits["Max file size"] == str(8 * 1024 * 1024), result.stdout
    assert limits["Max processes"] == "32", result.stdout
    assert limits["Max core file size"] == "0", result.stdout


# -- S4: nothing of a call outlives it -----------------------------------------------

TAKEOVER = r"""
import os, struct, sys, time
MARKER = {marker!r}
PAYLOAD = (  # what PID 1 would run: no parent-death signal, then wait forever
    "import ctypes, os\n"
    "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)\n"
    "os.write(1, b'TAKEN\\n')\n"
    "os.execv(" + repr(sys.executable) + ", [" + repr(sys.executable)
    + ", '-c', 'import time\\nwhile True: time.sleep(0.2)', " + repr(MARKER) + "])\n"
)

def take_over_pid_1():
    try:
        with open("/proc/1/syscall") as f:
            pc = int(f.read().split()[-1], 16)  # where PID 1 resumes after wait4
        mem = os.open("/proc/1/mem", os.O_RDWR)
    except OSError as exc:
        return "DENIED " + type(exc).__name__
    strings = [sys.executable.encode(), b"-c", PAYLOAD.encode()]
    code_size = 29
    data, addresses = b"", []
    for string in strings:
        addresses.append(pc + code_size + len(data))
        data += string + b"\0"
    argv = pc + code_size + len(data)
    data += b"".join(struct.pack("<Q", a) for a in addresses + [0])
    code = (b"\x48\xbf" + struct.pack("<Q", addresses[0])  # movabs rdi, path
            + b"\x48\xbe" + struct.pack("<Q", argv)         # movabs rsi, argv
            + b"\x31\xd2\xb8\x3b\x00\x00\x00\x0f\x05")      # edx = 0; execve
    os.pwrite(mem, code + data, pc)
    os.close(mem)
    if os.fork() == 0:  # wake PID 1: an orphan it adopted exits
        if os.fork() == 0:
            time.sleep(0.2)
            os._exit(0)
        os._exit(0)
    os.wait()
    time.sleep(1)
    return "WROTE"

print(take_over_pid_1(), flush=True)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the payload is x86-64 code")
@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_a_takeover_of_pid_1_fails_and_leaves_nothing_running(cgroup):
    """S1 + S4: the code wrote an ``execve`` into PID 1's memory; PID 1 then ran
    the payload, which cleared its parent-death signal and was still alive,
    reparented to the host's init, after the call returned."""
    marker = f"asyncrl-takeover-{uuid.uuid4().hex}"
    try:
        result = Sandbox(timeout_s=3, memory_mb=256, cgroup=cgroup).run(
            TAKEOVER.format(marker=marker)
        )
        assert processes_with(marker) == [], "a process of the call outlived it"
        assert "TAKEN" not in result.stdout, result
        assert result.stdout == "DENIED PermissionError\n", result
    finally:
        kill_all(processes_with(marker))


ESCAPE = r"""
import ctypes, os, signal, sys, time
prctl = ctypes.CDLL(None).prctl
MARKER = {marker!r}
loop = "import signal, time\n" \
    "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n" \
    "    signal.signal(s, signal.SIG_IGN)\n" \
    "while True:\n" \
    "    time.sleep(0.2)\n"
for _ in range(5):
    if os.fork() == 0:
        os.setsid()                   # its own session and process group
        prctl(1, 0, 0, 0, 0)          # no parent-death signal
        if os.fork():
            os._exit(0)               # double fork: reparented to PID 1
        os.execv(sys.executable, [sys.executable, "-c", loop, MARKER])

def running():
    found = 0
    for pid in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                found += MARKER.encode() in f.read()
        except OSError:
            pass
    return found

deadline = time.monotonic() + 8
while running() < 5 and time.monotonic() < deadline:
    time.sleep(0.05)
print("started", running(), flush=True)
{ending}
"""


@pytest.mark.parametrize("cgroup", ["auto", "off"])
@pytest.mark.parametrize(
    ("ending", "timeout_s"),
    [("", 20), pytest.param("time.sleep(60)", 6, marks=pytest.mark.slow)],
)
def test_no_process_survives_the_call_whatever_it_did(cgroup, ending, timeout_s):
    """S4: setsid, a double fork, no parent-death signal, ignored signals: none of it
    keeps a process alive once the call has returned, at its end or its time limit."""
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    try:
        result = Sandbox(timeout_s=timeout_s, memory_mb=256, cgroup=cgroup).run(
            ESCAPE.format(marker=marker, ending=ending)
        )
        survivors = processes_with(marker)  # at once: no grace period
        assert survivors == [], f"processes of the call outlived it: {result}"
        assert result.stdout == "started 5\n", result  # they were running
        assert result.timed_out == bool(ending), result
    finally:
        kill_all(processes_with(marker))


def test_the_calls_cgroups_are_removed():
    support = whole_call_limits()
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    try:
        result = Sandbox(timeout_s=20, memory_mb=256).run(
            ESCAPE.format(marker=marker, ending="1/0")
        )
        assert result.returncode == 1 and support.mode in result.layers, result
    finally:
        kill_all(processes_with(marker))
    mine = f"asyncrl-sandbox-{os.getpid()}-"
    for _, parent in support.parents:
        assert [name for name in os.listdir(parent) if name.startswith(mine)] == []


# -- S2: every writable mount has a size ---------------------------------------------

FILL_ROOT = """
import os
for folder in ("/", "/etc", "/dev"):
    written, error = 0, None
    try:
        for i in range(25):  # 400 MB in files under the 16 MB file-size limit
            with open(os.path.join(folder, "fill-%d" % i), "wb") as f:
                f.write(b"x" * (16 << 20))
            written += 16 << 20
    except OSError as exc:
        error = exc.strerror
    for i in range(25):
        try:
            os.unlink(os.path.join(folder, "fill-%d" % i))
        except OSError:
            pass
    print(folder, written >> 20, error)
with open("/dev/null", "w") as f:
    f.write("still a device")
print("null", len(open("/dev/zero", "rb").read(8)), len(open("/dev/urandom", "rb").read(8)))
"""


def test_the_root_etc_and_dev_take_no_writes():
    """S2: ``/``, ``/etc`` and ``/dev`` sat on bwrap's unsized root tmpfs: 400 MB
    went into each, all of it the host's memory."""
    result = Sandbox(timeout_s=30, memory_mb=256).run(FILL_ROOT)
    assert result.ok, result
    assert result.stdout.splitlines() == [
        "/ 0 Read-only file system",
        "/etc 0 Read-only file system",
        "/dev 0 Read-only file system",
        "null 8 8",
    ], result.stdout


# -- S3: memory, processes and CPU bound the call as a whole ----------------------------

HOLD = """
import os, struct, time
ready_r, ready_w = os.pipe()
children = []
for _ in range(21):
    pid = os.fork()
    if pid == 0:
        held = b"x" * (32 << 20)  # written: resident, not just reserved
        os.write(ready_w, struct.pack("i", os.getpid()))
        time.sleep(30)
        os._exit(0)
    children.append(pid)
time.sleep(2)
os.set_blocking(ready_r, False)
try:
    ready = os.read(ready_r, 4 * 21)
except BlockingIOError:
    ready = b""
holding = 0
for (pid,) in struct.iter_unpack("i", ready):
    if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still alive, holding its 32 MB
        holding += 1
print("holding", holding)
"""


@pytest.mark.slow
def test_forked_processes_share_one_memory_limit():
    """S3: with ``memory_mb=64`` (an address-space limit per process) 21 forked
    processes held 32 MB each, 672 MB in all."""
    whole_call_limits()
    sandbox = Sandbox(timeout_s=20, memory_mb=64)
    result = sandbox.run(HOLD)
    assert result.ok, result
    held_mb = 32 * int(result.stdout.split()[-1])
    assert held_mb <= sandbox.memory_mb + sandbox.tmp_mb + sandbox.shm_mb, result
    assert any("memory limit" in note and "killed" in note for note in result.notes), result


BUSY = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            pass
        os._exit(0)
    children.append(pid)
cpu = 0.0
for pid in children:
    _, _, usage = os.wait4(pid, 0)
    cpu += usage.ru_utime + usage.ru_stime
print("%.2f" % cpu)
"""


@pytest.mark.slow
def test_the_cpu_time_of_all_processes_together_is_bounded():
    """Four busy processes for 1.5 s of wall time at ``cpus=0.25``: at most about
    0.4 CPU-seconds between them (one CFS period of slack), not 4 x 1.5."""
    support = whole_call_limits()
    if "cpu" not in support.describe():
        pytest.skip(f"no cpu controller: {support.describe()}")
    result = Sandbox(timeout_s=10, memory_mb=256, cpus=0.25).run(BUSY)
    assert result.ok, result
    assert float(result.stdout) <= 0.25 * 1.5 + 0.15, result.stdout


# -- modes and their errors -------------------------------------------------------------


def test_the_preflight_says_which_limits_are_in_force():
    line = check_isolation(Sandbox(timeout_s=5, memory_mb=256))
    support = sandbox_cgroups.cgroup_support()
    assert line == support.describe()
    if support.mode == "none":
        assert "per process only" in line and support.reason in line
    else:
        assert "whole-call limits by cgroup" in line and "memory" in line and "pids" in line
    off = check_isolation(Sandbox(timeout_s=5, memory_mb=256, cgroup="off"))
    assert "per process only" in off


def test_without_a_cgroup_required_calls_are_not_run(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox_cgroups, "_SUPPORT", None)
    monkeypatch.setenv(sandbox_cgroups.CGROUP_ENV, str(tmp_path / "missing"))
    marker = tmp_path / "ran"
    result = Sandbox(timeout_s=5, memory_mb=256).run(f"open({str(marker)!r}, 'w')")
    assert result.returncode is None and not marker.exists(), result
    assert "whole-call limits are required" in result.stderr, result
    assert str(tmp_path / "missing") in result.stderr, result  # what is wrong, and where
    monkeypatch.setattr(sandbox_cgroups, "_SUPPORT", CgroupSupport("none", reason="no cgroup here"))
    monkeypatch.delenv(sandbox_cgroups.CGROUP_ENV)
    required = Sandbox(timeout_s=5, memory_mb=256, cgroup="required").run("print(1)")
    assert required.returncode is None and "no cgroup here" in required.stderr, required
    assert Sandbox(timeout_s=5, memory_mb=256).run("print(1)").stdout == "1\n"


def test_bad_cgroup_settings_are_rejected():
    with pytest.raises(ValueError, match="cgroup must be one of auto, required, off"):
        Sandbox(cgroup="on")
    with pytest.raises(ValueError, match="cpus"):
        Sandbox(cpus=0)


def test_a_calls_cgroup_gets_the_whole_call_limits(tmp_path):
    """The values written, on a stand-in directory: memory for the processes and
    both tmpfs together, the process count, a CPU quota."""
    limits = CallLimits(memory_bytes=144 << 20, pids=64, cpus=0.5)
    v2 = CgroupV2Call(str(tmp_path), limits, ["memory", "pids", "cpu"])
    written = {name: Path(v2.path, name).read_text() for name in os.listdir(v2.path)}
    assert written == {"memory.max": str(144 << 20), "pids.max": "64", "cpu.max": "50000 100000"}
    parents = {c: str(tmp_path / c) for c in ("memory", "pids", "cpu")}
    for path in parents.values():
        os.mkdir(path)
    v1 = CgroupV1Call(parents, limits)
    assert Path(v1.paths["memory"], "memory.limit_in_bytes").read_text() == str(144 << 20)
    assert Path(v1.paths["pids"], "pids.max").read_text() == "64"
    assert Path(v1.paths["cpu"], "cpu.cfs_quota_us").read_text() == "50000"


UNIFIED = "/sys/fs/cgroup/unified"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(os.path.join(UNIFIED, "cgroup.procs")),
    reason="no hybrid host's cgroup v2 hierarchy writable here",
)
def test_a_cgroup_v2_call_is_killed_whole_and_removed():
    """The v2 kill path (``cgroup.kill``) on a hybrid host's v2 hierarchy, which has
    no memory controller: a tree of processes in their own sessions is gone when
    ``close`` returns, and so is its cgroup."""
    group = CgroupV2Call(UNIFIED, CallLimits(1 << 30, 64, 1.0), [])
    if not os.path.exists(os.path.join(group.path, "cgroup.kill")):
        os.rmdir(group.path)
        pytest.skip("no cgroup.kill (Linux < 5.14)")
    tree = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time\n"
            "sys.stdin.read()\n"  # in the cgroup before it forks, however late add() comes
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    time.sleep(60)\n"
            "time.sleep(60)\n",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        group.add(tree.pid)
        tree.stdin.close()  # forks only now, inside the cgroup
        deadline = time.monotonic() + 10
        procs = Path(group.path, "cgroup.procs")
        while len(procs.read_text().split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = [int(pid) for pid in procs.read_text().split()]
        assert len(members) == 2
        assert group.close() == ()
        assert not os.path.exists(group.path)
        assert tree.wait(timeout=10) == -signal.SIGKILL
        for pid in members:  # gone, or a zombie not yet reaped by the host's init
            stat = Path(f"/proc/{pid}/stat")
            assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")
    finally:
        tree.kill()
        tree.wait()


HOST_CALL = """
import json, sys
from asyncrl.generation.envs.sandbox import Sandbox, check_isolation
line = check_isolation(Sandbox(timeout_s=5, memory_mb=256))
result = Sandbox(timeout_s=8, memory_mb=256).run(sys.argv[1])
print(json.dumps([line, result.stdout, result.layers]))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (util-linux) to run a generator as another user",
)
def test_as_another_user_without_cgroups_the_walls_still_hold():
    """Where no cgroup is writable (a generator that is not root), the preflight
    says limits are per process, and still nothing outlives the call and PID 1
    stays out of the code's reach."""
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    code = PROC_1 + ESCAPE.format(marker=marker, ending="time.sleep(60)")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    try:
        host = subprocess.run(
            [*as_nobody, sys.executable, "-c", HOST_CALL, code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={**os.environ, "PYTHONPATH": str(REPO)},  # asyncrl from this checkout
        )
        survivors = processes_with(marker)
        if host.returncode != 0 and "Error" in host.stderr and not host.stdout:
            pytest.skip(f"this checkout cannot run as uid 65534: {host.stderr[-300:]}")
        line, stdout, layers = json.loads(host.stdout)
        assert survivors == [], "processes of the call outlived it"
        assert "per process only" in line and "separate-user" not in layers, (line, layers)
        assert not {"cgroup-v1", "cgroup-v2"} & set(layers), layers
        assert "/proc/1/mem DENIED" in stdout and "started" in stdout, stdout
    finally:
        kill_all(processes_with(marker))
