"""`asyncrl launch` against someone who can write the run directory or reach this machine.

- A restarted generator runs with the config the launcher validated and holds in
  memory, never with ``RUN_DIR/config.yaml`` as it reads now: a
  ``reward.function`` planted there is never imported (the local launcher, and
  Ray, whose replacement actor gets the driver's config).
- No process of a run listens on a TCP port beyond loopback, one learner rank
  or two: no torch.distributed store, no gloo socket (``ss -ltnp`` while the
  learner trains).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from asyncrl.run.status import read_metrics
from tests.helpers.ray_runs import actor_process, assert_nothing_left, ray_temp_dir
from tests.helpers.run_processes import processes_of
from tests.helpers.watched_launch import Launch

pytestmark = pytest.mark.slow

LOOPBACK = {"127.0.0.1", "::1"}


def generators(run_dir: Path) -> list[psutil.Process]:
    return [p for p in processes_of(run_dir) if p.cmdline()[3:4] == ["generator"]]


# ------------------------------------------------------------------ the config


EVIL = """
from pathlib import Path

Path({marker!r}).write_text("imported")


def reward(data_source, solution_str, ground_truth, extra_info=None):
    Path({marker!r}).write_text("called")
    return 1.0
"""


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_restarted_generator_runs_the_launch_config_not_config_yaml(tmp_path, backend):
    marker, evil = tmp_path / "marker", tmp_path / "evil.py"
    evil.write_text(EVIL.format(marker=str(marker)))
    with contextlib.ExitStack() as stack:
        overrides = ["run.total_steps=20", "generators.replicas=1"]
        env = None
        if backend == "ray":
            ray_dir = stack.enter_context(ray_temp_dir())
            overrides.append("cluster.backend=ray")
            env = {"RAY_TMPDIR": str(ray_dir)}
        # One replica: the steps after the kill can only come from its restarted process.
        run = Launch(tmp_path, *overrides, env=env)
        try:
            run.wait_until(lambda: run.steps() >= 3, "step 3")
            config_file = run.run_dir / "config.yaml"
            launched = yaml.safe_load(config_file.read_text())
            planted = yaml.safe_load(config_file.read_text())
            planted["reward"]["function"] = f"{evil}:reward"  # a valid config: nothing refuses it
            config_file.write_text(yaml.safe_dump(planted, sort_keys=False))
            if backend == "local":
                [victim] = generators(run.run_dir)
            else:
                victim = actor_process(run.run_dir / "logs" / "generator-0.log", ray_dir)
            victim.kill()
            run.wait_until(lambda: "started again (restart 1)" in run.stderr(), "restart")
            handed = None
            if backend == "local":  # what the launcher handed the new process, as it started
                [restarted] = [p for p in generators(run.run_dir) if p.pid != victim.pid]
                handed = restarted.environ().get("ASYNCRL_CONFIG")
            assert run.process.wait(timeout=180) == 0, run.stderr()
        finally:
            run.stop()
        if backend == "ray":
            assert_nothing_left(ray_dir, run.run_dir)

    assert "generator-0 started again (restart 1)" in run.stderr()
    assert not marker.exists(), f"the planted reward function ran: {marker.read_text()}"
    if backend == "local":
        assert handed is not None and json.loads(handed) == launched
    records = read_metrics(run.run_dir)
    assert [r["version"] for r in records] == list(range(1, 21))
    # the new process ran `--restarts 1` (replica gen-0-r1), which the buffer counted
    assert records[-1]["generators_restarts_total"] == 1
    assert records[-1]["pool_default_restarts_total"] == 1
    trained = [json.loads(line) for line in (run.run_dir / "trained_groups.jsonl").open()]
    assert sorted(r["step"] for r in trained) == list(range(20))
    groups = [group for record in trained for group in record["group_ids"]]
    assert len(set(groups)) == len(groups), "a group trained twice"
    assert processes_of(run.run_dir) == []
    if backend == "ray":
        # a local Ray for the run, on loopback, every role placed and logging
        stdout = run.out.read_text()
        assert "ray: started a local Ray" in stdout
        assert "ray: endpoints on 127.0.0.1; node 127.0.0.1 (" in stdout
        assert "): buffer, learner, generator-0" in stdout
        saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())["cluster"]
        assert saved["backend"] == "ray" and saved["host"] == "127.0.0.1"
        assert saved["buffer_port"] > 0 and saved["weights_port"] > 0
        for name in ("buffer", "learner", "generator-0"):
            assert (run.run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
        assert records[-1]["generators_weight_swaps_total"] > 0
        # the killed actor's output, the driver's marker, the new actor's
        assert "asyncrl: actor generator-0 on 127.0.0.1: " in run.stderr()
        assert "restarting it in 1s; last lines of" in run.stderr()
        log = (run.run_dir / "logs" / "generator-0.log").read_text()
        before, after = log.split("---- asyncrl launch: restart 1 ----\n")
        pid = re.compile(r"asyncrl: ray actor generator-0: pid (\d+)")
        assert pid.findall(before) == [str(victim.pid)]
        assert len(pid.findall(after)) == 1 and pid.findall(after) != [str(victim.pid)]
        assert "loaded weights" in after  # the new actor's replica took new versions
        assert (run.run_dir / "final" / "config.json").exists()


# ------------------------------------------------------------------ the sockets


def listeners() -> list[tuple[str, str, int]]:
    """``(address, port, pid)`` of every listening TCP socket, from ``ss -ltnpH``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        address, port = fields[3].rsplit(":", 1)
        address = address.strip("[]").split("%")[0]  # [::1], 127.0.0.1%lo
        for pid in re.findall(r"pid=(\d+)", line):
            found.append((address, port, int(pid)))
    return found


def test_no_process_of_a_run_listens_beyond_loopback(tmp_path):
    # two learner ranks: every listener of a one-rank run (buffer, weights server, the
    # generators' engines) and the ranks' own gloo sockets besides
    ranks = 2
    run = Launch(tmp_path, "run.total_steps=8", f"learner.world_size={ranks}")
    seen: dict[tuple[str, str], str] = {}  # (address:port, pid) -> the process's command
    learner_pids: set[int] = set()
    try:
        while run.steps() < 6:  # sampled from the start up to a few trained steps
            assert run.process.poll() is None, run.stderr()
            commands = {}
            for process in run.tree():
                try:
                    commands[process.pid] = " ".join(process.cmdline())
                except psutil.Error:
                    continue
            learner_pids |= {pid for pid, cmd in commands.items() if "roles learner" in cmd}
            for address, port, pid in listeners():
                if pid in commands:
                    seen[(f"{address}:{port}", str(pid))] = commands[pid]
            time.sleep(0.2)
        assert run.process.wait(timeout=180) == 0, run.stderr()
    finally:
        run.stop()

    beyond = {
        where: cmd for where, cmd in seen.items() if where[0].rsplit(":", 1)[0] not in LOOPBACK
    }
    assert beyond == {}, f"listening beyond loopback: {beyond}"
    # the sampling saw the learner: each rank listens on loopback (gloo; rank 0 publishes)
    assert len(learner_pids) == ranks, learner_pids
    assert learner_pids <= {int(pid) for _, pid in seen}, (learner_pids, seen)
    assert processes_of(run.run_dir) == []
