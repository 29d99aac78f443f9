"""`cluster.backend: ray`: the quickstart with its roles as actors of a local Ray on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from asyncrl.config import ConfigError, load_config
from asyncrl.ray_cluster import (
    check_resources,
    generator_replicas,
    learner_bundles,
    local_num_cpus,
    local_resources,
    rank_env,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs/quickstart.yaml"


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


# ---------------------------------------------------------------- end to end


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[Path]:
    """A short, private RAY_TMPDIR (Ray's socket paths must stay short), so every Ray
    process of one test can be told apart from other Ray instances on the machine."""
    path = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def launch(run_dir: Path, ray_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(QUICKSTART), "cluster.backend=ray",
        *overrides, "--run-dir", str(run_dir), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "RAY_TMPDIR": str(ray_dir)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def processes_of(ray_dir: Path, run_dir: Path) -> list[psutil.Process]:
    """Live processes of this test's Ray: its daemons name the temp dir, its workers
    (renamed ``ray::...``) inherited it in their environment."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(process.info["cmdline"] or [])
        with contextlib.suppress(psutil.Error):
            named = str(ray_dir) in cmdline or str(run_dir) in cmdline
            if named or process.environ().get("RAY_TMPDIR") == str(ray_dir):
                found.append(process)
    return found


def assert_nothing_left(ray_dir: Path, run_dir: Path) -> None:
    deadline = time.monotonic() + 10  # the driver has exited; give init a moment to reap
    while (left := processes_of(ray_dir, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for process in left:  # ours (found by our temp dir): do not leak them into other tests
        with contextlib.suppress(psutil.Error):
            process.kill()
    assert left == [], [p.info["cmdline"] for p in left]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_quickstart_runs_on_ray_with_two_generator_actors(tmp_path):
    run_dir = tmp_path / "run"
    with ray_temp_dir() as ray_dir:
        result = launch(run_dir, ray_dir, "run.total_steps=30", "tracking.aim=false")
        assert_nothing_left(ray_dir, run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ray: started a local Ray" in result.stdout
    assert "ray: endpoints on 127.0.0.1; node 127.0.0.1 (" in result.stdout
    assert "): buffer, learner, generator-0, generator-1" in result.stdout

    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, 31))
    assert [r["step"] for r in records] == list(range(30))
    assert all(r["staleness_max"] <= 1 for r in records)
    # both generator actors sent samples: each reported its counters with them
    assert records[-1]["pool_default_replicas"] == 2
    assert records[-1]["generators_weight_swaps_total"] > 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["cluster"]
    assert saved["backend"] == "ray" and saved["host"] == "127.0.0.1"
    assert saved["buffer_port"] > 0 and saved["weights_port"] > 0
    for name in ("buffer", "learner", "generator-0", "generator-1"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    assert "loaded weights" in (run_dir / "logs" / "generator-1.log").read_text()
    assert (run_dir / "final" / "config.json").exists()


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
