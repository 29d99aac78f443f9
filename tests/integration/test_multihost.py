"""Runs across three test hosts (network namespaces on one machine, asyncrl.testbed) on a
Ray cluster spanning them: the buffer and learner on host a, one generator on each of b
and c, CURVE on every connection, weights over the links.

1. The quickstart learns across the hosts; the roles listen only on host a's address,
   the generators on nothing; a peer without the run's keys is never answered.
2. Faults on the links: 50 ms and 1% loss on b's, c's limited and then cut for 30 s.
   The run goes on with b, c's groups are handed out again, c comes back and is
   served, no prompt is trained twice or lost, and weights cross by the collective path.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import pytest

from asyncrl.testbed.hosts import unavailable_reason
from asyncrl.testbed.ray_nodes import WORKER_PORTS
from tests.helpers.faults import final_ledger
from tests.helpers.multihost import Launch, cluster, logged_at

WHY_NOT = unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""),
]

A, B, C = "10.77.0.1", "10.77.0.2", "10.77.0.3"
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
CUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 10.0
C_RATE_BITS = 10e6

STRANGER = """
import sys, zmq
host, port, mechanism = sys.argv[1], int(sys.argv[2]), sys.argv[3]
context = zmq.Context()
socket = context.socket(zmq.DEALER)
socket.linger = 0
if mechanism == "curve":  # keys of its own, the server's public key guessed right
    public, secret = zmq.curve_keypair()
    socket.curve_serverkey = open(sys.argv[4], "rb").read().split(b'"')[1]
    socket.curve_publickey, socket.curve_secretkey = public, secret
socket.connect(f"tcp://{host}:{port}")
socket.send(b"hello")
print("answered" if socket.poll(3000) else "silence", flush=True)
"""


def ask_as_a_stranger(launch: Launch, host, port: int, mechanism: str) -> str:
    server_key = launch.run_dir / "keys" / "server.key"
    argv = [sys.executable, "-c", STRANGER, A, str(port), mechanism, str(server_key)]
    return host.run(argv, timeout=30).stdout.strip()


def actor_listeners(host) -> list[tuple[str, int]]:
    """What the run's actors (Ray workers, ``ray::RoleActor``) listen on, on ``host``."""
    found = []
    for address, port, pid in host.listeners():
        if pid is None:
            continue
        title = Path(f"/proc/{pid}/cmdline")
        if title.exists() and "RoleActor" in title.read_bytes().decode(errors="replace"):
            found.append((address, port))
    return found


def ray_worker_port(port: int) -> bool:
    return WORKER_PORTS[0] <= port <= WORKER_PORTS[1]


def test_the_quickstart_learns_across_three_hosts_with_curve_listening_only_on_the_head(
    tmp_path,
):
    with cluster() as hosts:
        run = hosts.launch(tmp_path / "run")
        run.wait_for_step(20)
        listening = {name: actor_listeners(hosts.bed[name]) for name in "abc"}
        config = (run.run_dir / "config.yaml").read_text()
        ports = {key: int(re.search(rf"{key}: (\d+)", config).group(1))
                 for key in ("buffer_port", "weights_port")}  # fmt: skip
        strangers = {
            (port_name, mechanism): ask_as_a_stranger(run, hosts.bed["b"], port, mechanism)
            for port_name, port in ports.items()
            for mechanism in ("null", "curve")
        }
        assert run.wait(600) == 0, run.output()[-3000:]

    assert run.placement() == {A: ["buffer", "learner"], B: ["generator-0"], C: [
        "generator-1"]} or run.placement() == {A: ["buffer", "learner"], B: ["generator-1"],
        C: ["generator-0"]}, run.output()  # fmt: skip
    # beyond loopback, the roles listen on host a's address alone (their two endpoints) and
    # the generators on nothing; what listens on every interface is Ray's own worker port
    # (its token guards it). Loopback (the learner's one-rank gloo group) no host reaches.
    reachable = {
        name: {(address, port) for address, port in found
               if not ray_worker_port(port) and address not in LOOPBACK}
        for name, found in listening.items()
    }  # fmt: skip
    assert reachable == {
        "a": {(A, ports["buffer_port"]), (A, ports["weights_port"])}, "b": set(), "c": set()
    }, listening
    # a peer on b without the run's keys is never answered, on either endpoint
    assert set(strangers.values()) == {"silence"}, strangers

    records = run.records()
    assert len(records) == 600
    final = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert final >= 0.95, final  # the quickstart's target: 0.996 on one host
    last = records[-1]
    # shared memory is per host: every replica fell back to ZeroMQ across the link
    assert last["generators_weights_loads_zmq_total"] >= 2 * 500, last
    assert last.get("generators_weights_loads_shm_total", 0) == 0
    assert last["weights_refused_auth_total"] >= 1  # the CURVE stranger, at the weights


@pytest.mark.skipif(unavailable_reason(shaped=True) is not None,
                    reason=unavailable_reason(shaped=True) or "")  # fmt: skip
def test_latency_loss_and_a_cut_host_are_survived_and_every_prompt_is_accounted_for(tmp_path):
    # Ray's own health check must outlast the cut, so c's node (and its actor) survive it
    ray_env = {"RAY_health_check_failure_threshold": "40"}
    with cluster(shaped=("b",), system_env=ray_env) as hosts:
        bed = hosts.bed
        bed.limit("c", "10mbit")  # c's weight transfers take seconds
        run = hosts.launch(
            tmp_path / "run",
            "run.total_steps=5000", "learner.checkpoint_every=10",
            "weights.transport=collective", "weights.deadline_s=10",
            f"buffer.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g}",
            "model.tiny={hidden_size: 128, num_layers: 4, num_heads: 4, intermediate_size: 512}",
        )  # fmt: skip
        run.wait_for_step(5)
        bed.shape("b", 50, 0.01)
        run.wait_for_step(15)
        on_c = run.generator_on(C)
        bed.wait_for_transfer("c", C_RATE_BITS)  # the cut lands in a weight transfer
        cut_at_step = run.steps()
        cut = time.time()
        bed.cut("c")
        silent = run.until(
            f"{on_c}'s groups requeued",
            lambda: f"generator {on_c} silent for over" in run.log("buffer"),
            timeout_s=CUT_S,
        )
        time.sleep(max(0.0, cut + CUT_S - time.time()))
        steps_during_cut = run.steps() - cut_at_step
        bed.restore("c")
        restored = time.time()
        run.until(f"{on_c}'s samples again", lambda: c_serves_again(run, on_c))
        after = run.steps()
        run.wait_for_step(after + 10)
        run.process.send_signal(signal.SIGTERM)
        stopped = run.wait(180)
        link_b = bed["b"].link.stats()

    assert stopped == 128 + signal.SIGTERM, run.output()[-3000:]
    assert "asyncrl: stopped" in run.output()
    assert steps_during_cut >= 2, steps_during_cut  # b alone kept the learner fed
    assert cut < silent < restored  # handed out again during the cut, not at its end
    # c's transfer cut short missed its deadline and was said; c never served a part of
    # it: it either kept a whole version or exited and was started again
    generator_c = run.log("generator-" + on_c.removeprefix("gen-"))
    assert re.search(r"weight sync over \w+ failed \(holding v\d+, deadline 10s, missed\)",
                     generator_c), generator_c[-3000:]  # fmt: skip
    buffer_log = run.log("buffer")
    returned = f"generator {on_c}(-r1 \\(pool default\\) joined| is back after)"
    back = logged_at(buffer_log, returned)
    assert back is not None and back >= restored - 1.0, buffer_log[-3000:]
    ledger = final_ledger(run.run_dir)
    assert ledger.repeated() == [] and ledger.unaccounted() == []
    last = run.records()[-1]
    assert last["buffer_requeued_groups"] >= 1
    assert last["generators_weights_loads_collective_total"] >= 1
    assert link_b[1] >= 1  # frames b sent that its link dropped


def c_serves_again(run: Launch, generator_id: str) -> bool:
    """The generator on the cut host is heard from again and its samples accepted: the same
    process (its link back), or its replacement (it exited on a weight transfer the cut
    left half done, and was started again)."""
    buffer_log = run.log("buffer")
    if f"generator {generator_id}: first sample accepted since" in buffer_log:
        return True
    replaced = f"generator {generator_id}-r1 (pool default) joined" in buffer_log
    records = run.records()
    return replaced and bool(records) and records[-1].get("generators_restarts_total", 0) >= 1

