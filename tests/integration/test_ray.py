"""`cluster.backend: ray`: the quickstart with its roles as actors of a local Ray on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.core.security import provision_run
from asyncrl.core.stop_signals import StopSignals
from asyncrl.run.ray.plan import (
    check_resources,
    generator_replicas,
    learner_bundles,
    local_num_cpus,
    local_resources,
    rank_env,
)
from asyncrl.run.ray.run import RayRun
from asyncrl.run.status import read_metrics
from tests.helpers.ray_runs import (
    QUICKSTART,
    REPO,
    FakeRay,
    FakeTaskError,
    RecordingConsole,
    assert_nothing_left,
    ray_temp_dir,
)

# ---------------------------------------------------------------- the config


def test_ray_backend_validates_and_a_bad_backend_is_named():
    config = load_config(QUICKSTART, ["cluster.backend=ray", "learner.num_cpus_per_rank=2"])
    assert config.cluster.backend == "ray" and config.cluster.address is None
    assert load_config(QUICKSTART).cluster.backend == "local"
    with pytest.raises(ConfigError) as error:
        load_config(QUICKSTART, ["cluster.backend=slurm"])
    assert "cluster.backend" in str(error.value) and "'ray'" in str(error.value)
    with pytest.raises(ConfigError, match=r"learner\.placement"):
        load_config(QUICKSTART, ["learner.placement=ANYWHERE"])


def test_the_plan_follows_the_resources_the_config_asks_for():
    config = load_config(
        QUICKSTART,
        [
            "learner.world_size=2", "learner.num_cpus_per_rank=4", "learner.num_gpus_per_rank=1",
            "cluster.buffer_num_cpus=0.5", "generators.num_gpus=0.5",
            "learner.resources={learner_node: 1}",
            "generators.pools=[{name: big, replicas: 2, num_cpus: 3}, {name: small, replicas: 1}]",
        ],
    )  # fmt: skip
    # bundle 0 holds rank 0 and the buffer: one address serves both endpoints
    assert learner_bundles(config) == [
        {"CPU": 4.5, "learner_node": 1.0, "GPU": 1.0},
        {"CPU": 4.0, "learner_node": 1.0, "GPU": 1.0},
    ]
    assert generator_replicas(config) == [
        ("generator-big-0", "big", 0, 3.0, 0.5),
        ("generator-big-1", "big", 1, 3.0, 0.5),
        ("generator-small-0", "small", 0, 1.0, 0.5),
    ]
    assert local_num_cpus(config) == 16  # 4.5 + 4 + 3 + 3 + 1, rounded up
    assert local_resources(config) == {"learner_node": 2.0}
    assert check_resources(config) == []
    env = rank_env(1, 2, "10.0.0.5", 29500)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("1", "2", "10.0.0.5")
    assert (env["MASTER_PORT"], env["LOCAL_RANK"]) == ("29500", "0")


def test_settings_ray_cannot_honour_are_refused_naming_the_keys():
    config = load_config(QUICKSTART, ["cluster.backend=ray", "learner.device=cuda"])
    (problem,) = check_resources(config)
    assert "learner.device=cuda" in problem and "learner.num_gpus_per_rank" in problem
    config = load_config(QUICKSTART, ["cluster.backend=ray", "learner.resources={GPU: 1}"])
    (problem,) = check_resources(config)
    assert "learner.resources" in problem and "learner.num_gpus_per_rank" in problem


# ------------------------------------------------- supervision, on a scripted Ray


def supervised(tmp_path: Path, script: Callable[[FakeRay], None]) -> tuple:
    """RayRun.supervise on the quickstart (one generator) against a scripted Ray."""
    config = load_config(QUICKSTART, ["cluster.backend=ray", "generators.replicas=1"])
    ray, console = FakeRay(script), RecordingConsole()
    (tmp_path / "logs").mkdir()  # made by the launcher before RayRun
    run = RayRun(ray, config, tmp_path, None, StopSignals())
    run.create_actors()
    run.run_roles()
    return run.supervise(console), ray, console


@pytest.mark.parametrize("transport", ["collective", "zmq"])
def test_the_endpoints_ray_resolves_include_the_collective_group_port(tmp_path, transport):
    # without it the learner's group store got a port no replica was told, and every
    # replica on Ray fell back from the collective path at each sync
    config = load_config(QUICKSTART, ["cluster.backend=ray", f"weights.transport={transport}"])
    run = RayRun(FakeRay(lambda ray: None), config, tmp_path, None, StopSignals())
    run.create_actors()
    resolved = run.resolve_endpoints()
    assert (resolved.cluster.buffer_port, resolved.cluster.weights_port) == (41000, 41001)
    assert resolved.weights.group_port == (41002 if transport == "collective" else 0)


def generator_fails_once(ray: FakeRay) -> None:
    """generator-0's role raises; its new actor (restart 1) runs, then the learner finishes."""
    generator = ray.run_of("generator-0")
    if not generator.done:
        generator.finish(FakeTaskError(RuntimeError("boom")))
    with contextlib.suppress(LookupError):
        ray.run_of("generator-0", restarts=1)
        ray.run_of("learner").finish()


def test_a_generator_whose_role_raises_gets_a_new_actor_with_restarts_1(tmp_path):
    failure, ray, console = supervised(tmp_path, generator_fails_once)
    assert failure is None
    first_actor = ray.runs[2][0]
    assert ray.killed == [first_actor]  # its resources freed for the new one
    assert [argv[2:] for _, argv, _ in ray.runs if argv[0] == "generator"] == [
        ["--index", "0", "--pool", "default"],
        ["--index", "0", "--pool", "default", "--restarts", "1"],
    ]
    stopped, again = console.notes
    assert stopped.startswith("asyncrl: actor generator-0 on 10.0.0.9: stopped after ")
    assert stopped.endswith(" (RuntimeError: boom); restarting it in 1s")  # an empty log
    assert again == "asyncrl: generator-0 started again (restart 1) on 10.0.0.9"
    # waiting out the back-off, then for Ray to place the new actor (restart 1)
    assert console.states == [("alive", 0), ("restarting", 0), ("restarting", 1), ("alive", 1)]
    log = (tmp_path / "logs" / "generator-0.log").read_text()
    assert log == "---- asyncrl launch: restart 1 ----\n"  # the fake actors write nothing


def test_each_actor_is_handed_its_role_s_credentials_a_restarted_one_too(tmp_path):
    config = load_config(QUICKSTART, ["cluster.backend=ray", "generators.replicas=1"])
    config, credentials = provision_run(config, tmp_path)

    ray = FakeRay(generator_fails_once)
    (tmp_path / "logs").mkdir()
    run = RayRun(ray, config, tmp_path, None, StopSignals(), credentials)
    run.create_actors()
    run.hand_out()
    run.run_roles()
    assert run.supervise(RecordingConsole()) is None
    roles = [argv[0] for argv, _ in ray.handed]
    assert roles == ["buffer", "learner", "generator", "generator"]  # the last: the restart
    for argv, handed in ray.handed:
        assert handed == credentials.for_role(argv[0]).to_json(), argv
    assert credentials.passwords["learner"] not in "".join(h for _, h in ray.handed[2:])
    learner_password = credentials.passwords["learner"]
    assert not any(learner_password in json.dumps(member.env) for member in run.members)


def test_the_buffer_stopping_still_fails_the_run_at_once(tmp_path):
    def script(ray: FakeRay) -> None:
        if ray.run_of("generator-0").done:
            ray.run_of("buffer").finish()
        else:  # a generator returning is restarted, not a failure
            ray.run_of("generator-0").finish()

    failure, _, console = supervised(tmp_path, script)
    assert failure == "actor buffer on 10.0.0.9: stopped before the learner finished"
    assert "(its role returned); restarting it in 1s" in console.notes[0]


# ---------------------------------------------------------------- end to end


def launch_command(run_dir: Path, ray_dir: Path, *overrides: str) -> dict:
    """``subprocess`` arguments of ``asyncrl launch --quiet`` on the quickstart under Ray."""
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(QUICKSTART), "cluster.backend=ray",
        *overrides, "--run-dir", str(run_dir), "--quiet",
    ]  # fmt: skip
    return {"args": command, "cwd": REPO, "env": {**os.environ, "RAY_TMPDIR": str(ray_dir)}}


def launch(run_dir: Path, ray_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    arguments = launch_command(run_dir, ray_dir, *overrides)
    return subprocess.run(**arguments, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_failing_actor_fails_the_run_naming_it_and_its_error(tmp_path):
    run_dir = tmp_path / "run"
    with ray_temp_dir() as ray_dir:
        # no such model: the roles that load it fail at start-up
        result = launch(
            run_dir, ray_dir, "model.tiny=null", "model.name_or_path=/nonexistent/model",
            "tracking.aim=false",
        )  # fmt: skip
        assert_nothing_left(ray_dir, run_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "asyncrl: run failed: actor " in result.stderr
    assert "/nonexistent/model" in result.stderr
    # the tail of that actor's log, which holds the role's traceback
    assert f"last lines of {run_dir / 'logs'}" in result.stderr and 'File "' in result.stderr


TWO_NODES = """
import sys
from ray.cluster_utils import Cluster

store = 100 * 1024**2
head = {"num_cpus": 3, "resources": {"learner_node": 2}, "object_store_memory": store}
cluster = Cluster(initialize_head=True, head_node_args=head)
cluster.add_node(num_cpus=3, object_store_memory=store)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
cluster.shutdown()
"""


@pytest.mark.slow
def test_the_two_node_example_places_the_learner_and_the_generators_apart(tmp_path):
    """examples/two_node on two Ray nodes of this machine (both on 127.0.0.1), with two
    learner ranks: the buffer and the ranks go to the node offering `learner_node`, the
    generator pools to the other."""
    run_dir = tmp_path / "run"
    with ray_temp_dir() as ray_dir:
        env = {**os.environ, "RAY_TMPDIR": str(ray_dir), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        cluster = subprocess.Popen(
            [sys.executable, "-c", TWO_NODES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        try:
            address = cluster.stdout.readline().strip()
            command = [
                sys.executable, "-m", "asyncrl", "launch", "examples/two_node/two_node.yaml",
                f"cluster.address={address}", "run.total_steps=10", "tracking.aim=false",
                "learner.num_threads=1", "learner.world_size=2", "learner.num_cpus_per_rank=1",
                "cluster.buffer_port=0", "cluster.weights_port=0",
                "generators.pools=[{name: main, replicas: 1, num_cpus: 2},"
                " {name: eager, replicas: 1, num_cpus: 1, chunk_tokens: 1}]",
                "--run-dir", str(run_dir), "--quiet",
            ]  # fmt: skip
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env
            )
        finally:
            cluster.stdin.close()
            try:
                cluster.wait(timeout=60)
            except subprocess.TimeoutExpired:
                cluster.kill()
                cluster.wait()
        assert_nothing_left(ray_dir, run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ray: joining the cluster at {address}" in result.stdout
    assert "ray: joined: 6 CPUs, 0 GPUs on 2 node(s)" in result.stdout
    nodes = re.findall(r"node 127\.0\.0\.1 \((\w+)\): ([\w, -]+)", result.stdout)
    assert [names for _, names in nodes] == [
        "buffer, learner-0, learner-1",
        "generator-main-0, generator-eager-0",
    ], result.stdout
    assert nodes[0][0] != nodes[1][0]
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, 11))
    assert records[-1]["pool_main_replicas"] == 1 and records[-1]["pool_eager_replicas"] == 1
    assert "rank 1 of 2" in (run_dir / "logs" / "learner-1.log").read_text()
