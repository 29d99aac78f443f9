"""A key per role, with real processes: each started role is handed its own role's
credentials and nothing else, a process holding only what a generator can read
cannot act as the learner in a live run, and a CURVE run trains with no learner key
on disk.

The attack of issue 27 (N2): on a loopback run every role used to read one
``RUN_DIR/keys/run.secret`` and derive its password as ``HMAC(secret, role)``,
so a generator derived the learner's, logged in as the learner, was handed real
batches and moved the buffer's version, and the real learner's requests were
refused from then on. Here the attacker tries every secret it can read in the
keys folder, and every ``HMAC(secret, "learner")``, against a launched run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import zmq

from asyncrl.config import load_config
from asyncrl.core.credentials import CREDENTIALS_FD_ENV
from asyncrl.core.keys_folder import password_file
from asyncrl.core.messages import (
    BatchRequest,
    ErrorReply,
    SaveBufferState,
    StartEval,
    Status,
    StatusRequest,
    decode,
    encode,
)
from asyncrl.core.security import provision_run
from asyncrl.core.transport import tcp
from asyncrl.run.local_run import Supervisor
from asyncrl.run.status import read_metrics
from tests.helpers.run_processes import processes_of
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 150
NO_REPLY_MS = 2000
"""How long a request that must go unheard waits (a refused handshake never answers)."""

STAND_IN = """
import json, os, sys
from asyncrl.core.credentials import receive_handed
fd = os.environ.get("{env}")
credentials = receive_handed()
report = {{
    "credentials": json.loads(credentials.to_json()),
    "environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
    "argv": sys.argv,
    "pipe_still_open": os.path.exists(f"/proc/self/fd/{{fd}}"),
}}
with open(sys.argv[1], "w") as out:
    json.dump(report, out)
"""


def test_each_started_process_is_handed_its_own_role_s_credentials_alone(tmp_path):
    """The local launcher's processes, with a stand-in for each role's program: what each
    reads from its pipe is its role's share, and no secret is in a file, a command line
    or an environment."""
    config, credentials = provision_run(load_config(QUICKSTART), tmp_path)
    (tmp_path / "logs").mkdir()
    supervisor = Supervisor(config, tmp_path, credentials=credentials)
    real_spawn = supervisor._spawn
    reports = {}

    def spawn(name, command, env=None):
        reports[name] = tmp_path / f"{name}.json"
        stand_in = STAND_IN.format(env=CREDENTIALS_FD_ENV)
        return real_spawn(name, [sys.executable, "-c", stand_in, str(reports[name])], env)

    supervisor._spawn = spawn
    roles = {"buffer": "buffer", "learner": "learner", "main-0": "generator"}
    for name, role in roles.items():
        supervisor.start(name, role)
    for process in supervisor.all_processes():
        assert process.wait(60) == 0, supervisor.log_tail(next(iter(reports)))
    learner_password = credentials.passwords["learner"]
    learner_seed = credentials.group_seeds["learner"]
    for name, role in roles.items():
        report = json.loads(reports[name].read_text())
        assert report["credentials"] == json.loads(credentials.for_role(role).to_json()), name
        assert not report["pipe_still_open"], name  # read once and closed: no child inherits
        everything_else = report["environ"] + " ".join(report["argv"])
        assert learner_password not in everything_else and learner_seed not in everything_else
        if role != "learner":
            assert learner_password not in json.dumps(report["credentials"]), name
    holders = [
        p.name for p in tmp_path.rglob("*") if p.is_file() and learner_password in p.read_text()
    ]
    assert holders == ["learner.json"]  # the learner stand-in's report; no file of the run


# ---------------------------------------------------------------------- the attack


def readable_secrets(keys_dir: Path) -> set[bytes]:
    """Every secret a generator process can read in the keys folder, and what the old
    scheme derived from each as the learner's password."""
    found = {path.read_bytes().strip() for path in keys_dir.iterdir() if path.is_file()}
    derived = {hmac.new(s, b"learner", hashlib.sha256).hexdigest().encode() for s in found}
    return found | derived


def socket_as(role: bytes, password: bytes, endpoint: str) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    context.setsockopt(zmq.PLAIN_USERNAME, role)
    context.setsockopt(zmq.PLAIN_PASSWORD, password)
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    return context, socket


def send_or_drop(socket: zmq.Socket, message, wait_ms: int = 0) -> bool:
    """Send ``message`` unless the socket cannot queue it within ``wait_ms``: once a
    socket's login has been refused it may have no pipe left to queue on, and a plain
    send would block for ever. Dropped, the message is not heard either."""
    socket.setsockopt(zmq.SNDTIMEO, wait_ms)
    try:
        socket.send_multipart(encode(message))
    except zmq.Again:
        return False
    return True


def ask(socket: zmq.Socket, message, wait_ms: int = NO_REPLY_MS):
    """The reply to ``message``, or None if none comes within ``wait_ms``."""
    if not send_or_drop(socket, message, wait_ms):
        return None
    if not socket.poll(wait_ms):
        return None
    reply, _ = decode(socket.recv_multipart())
    return reply


def test_a_generator_cannot_act_as_the_learner_in_a_live_run(tmp_path):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable, "-m", "asyncrl", "launch", str(QUICKSTART),
            f"run.total_steps={STEPS}", "tracking.aim=false", "--run-dir", str(run_dir), "--quiet",
        ],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    made: list[zmq.Context] = []
    try:
        wait_until(
            lambda: len(read_metrics(run_dir)) >= 2, 180, what="the first steps", every_s=0.2
        )
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        endpoint = tcp("127.0.0.1", config["cluster"]["buffer_port"])
        secrets = readable_secrets(Path(config["cluster"]["keys_dir"]))

        # 1. log in as the learner with anything a generator can read: never heard
        impostors = []
        for secret in secrets:
            context, socket = socket_as(b"learner", secret, endpoint)
            made.append(context)
            send_or_drop(socket, BatchRequest(policy_version=0))
            impostors.append(socket)
        time.sleep(NO_REPLY_MS / 1000)
        answered = [socket for socket in impostors if socket.poll(0)]
        assert not answered, "a secret a generator can read logged in as the learner"
        # a refused socket retries its login every 100 ms: end them, or their handshakes
        # queue ahead of the logins below on a busy machine
        while made:
            made.pop().destroy(linger=0)

        # 2. log in as what it is, a generator (with the secret a joining generator is
        # given), and ask for the learner's things
        secret = password_file(Path(config["cluster"]["keys_dir"]), "generator").read_bytes()
        context, generator = socket_as(b"generator", secret.strip(), endpoint)
        made.append(context)
        status = ask(generator, StatusRequest(), 10_000)
        assert isinstance(status, Status), f"the generators' own secret did not log in: {status}"
        version = status.policy_version
        forged = [
            BatchRequest(policy_version=version),
            BatchRequest(policy_version=version + 1),
            StartEval(round=1, policy_version=version + 1),
            SaveBufferState(step=version),
        ]
        for message in forged:
            reply = ask(generator, message, 10_000)
            assert isinstance(reply, ErrorReply) and reply.reason == "forbidden", reply
        after = ask(generator, StatusRequest(), 10_000)
        assert after.stats["buffer_rejected_forbidden"] >= len(forged)

        output, _ = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, output
    finally:
        for context in made:
            context.destroy(linger=0)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    records = read_metrics(run_dir)  # training unaffected: every step, every sample
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["samples_total"] == STEPS * 256
    assert records[-1]["buffer_rejected_forbidden"] >= len(forged)  # counted, in the metrics
    buffer_log = (run_dir / "logs" / "buffer.log").read_text()
    assert "refused a PLAIN peer with a wrong password for 'learner'" in buffer_log
    assert not processes_of(run_dir)


def test_a_curve_run_with_the_collective_path_trains_with_no_learner_key_on_disk(tmp_path):
    """Beyond loopback: `asyncrl keys` writes no learner keypair; the launcher makes one
    for the learner alone, and the weight-update group's keys (the learner's derived from
    the servers' secret, the replicas' from theirs) let every replica in."""
    run_dir = tmp_path / "run"
    keys = subprocess.run(
        [sys.executable, "-m", "asyncrl", "keys", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert keys.returncode == 0, keys.stderr
    steps = 12
    launched = subprocess.run(
        [
            sys.executable, "-m", "asyncrl", "launch", str(QUICKSTART), "--run-dir", str(run_dir),
            "cluster.curve=true", "weights.transport=collective", f"run.total_steps={steps}",
            "tracking.aim=false", "--quiet",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout + launched.stderr
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["weights_collective_joins_accepted_total"] >= 1
    assert records[-1]["weights_collective_transfers_finished_total"] >= 1
    assert records[-1].get("weights_collective_joins_refused_total", 0) == 0
    assert sorted(path.name for path in (run_dir / "keys").iterdir()) == [
        "client.key", "client.key_secret", "group.key", "server.key", "server.key_secret",
    ]  # fmt: skip
