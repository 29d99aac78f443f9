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
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
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


# ------------------------------------------------- supervision, on a scripted Ray


class FakeTaskError(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class FakeRef:
    """A task's result: pending until the test finishes it."""

    def __init__(self, value: object = None, done: bool = False):
        self.value, self.error, self.done = value, None, done

    def finish(self, error: BaseException | None = None) -> None:
        self.error, self.done = error, True


class FakeActor:
    def __init__(self, ray: FakeRay):
        info = {"ip": "10.0.0.9", "node_id": "abcdef12", "pid": 4242}
        self.start = SimpleNamespace(remote=lambda *args: FakeRef(info, done=True))
        self.free_ports = SimpleNamespace(
            remote=lambda host, count: FakeRef(list(range(41000, 41000 + count)), done=True)
        )
        self.run = SimpleNamespace(
            remote=lambda argv, env, credentials: ray.started(self, argv, credentials)
        )


class FakeRay:
    """What RayRun calls of ray, with each role's task finished by ``script``."""

    exceptions = SimpleNamespace(RayError=FakeTaskError, RayTaskError=FakeTaskError)

    def __init__(self, script: Callable[[FakeRay], None]):
        self.script = script
        self.runs: list[tuple[FakeActor, list[str], FakeRef]] = []
        self.killed: list[FakeActor] = []
        self.handed: list[tuple[list[str], str | None]] = []
        """Each role run's argv and the credentials handed with the call."""

    def started(self, actor: FakeActor, argv: list[str], credentials: str | None) -> FakeRef:
        self.runs.append((actor, argv, FakeRef()))
        self.handed.append((argv, credentials))
        return self.runs[-1][2]

    def run_of(self, name: str, restarts: int = 0) -> FakeRef:
        """The role ``name`` (buffer, learner, generator-0) ran with ``--restarts``."""
        for _, argv, ref in self.runs:
            restarted = int(argv[argv.index("--restarts") + 1]) if "--restarts" in argv else 0
            if argv[0] == name.split("-")[0] and restarted == restarts:
                return ref
        raise LookupError(f"{name} was not run with --restarts {restarts}")

    def remote(self, cls: type) -> SimpleNamespace:
        actors = SimpleNamespace(remote=lambda: FakeActor(self))
        return SimpleNamespace(options=lambda **options: actors)

    def wait(self, refs: list[FakeRef], num_returns: int = 1, timeout: float = 0):
        if self.runs:  # the roles have started (not while placing the actors)
            self.script(self)
        time.sleep(0.01)
        done = [ref for ref in refs if ref.done][:num_returns]
        return done, [ref for ref in refs if ref not in done]

    def get(self, refs: FakeRef | list[FakeRef]) -> object:
        if isinstance(refs, list):
            return [self.get(ref) for ref in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def kill(self, actor: FakeActor) -> None:
        self.killed.append(actor)


class RecordingConsole:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.states: list[tuple[str, int]] = []

    def note(self, message: str, error: bool = False) -> None:
        self.notes.append(message)

    def update(self, health: list) -> None:
        for replica in health:
            if replica.name == "generator-0" and (replica.state, replica.restarts) not in (
                self.states[-1:] or [None]
            ):
                self.states.append((replica.state, replica.restarts))


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


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[Path]:
    """A short, private RAY_TMPDIR (Ray's socket paths must stay short), so every Ray
    process of one test can be told apart from other Ray instances on the machine."""
    path = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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


def actor_process(log_path: Path, ray_dir: Path) -> psutil.Process:
    """The process of the actor that last started writing ``log_path`` (each actor says
    its pid there), checked to belong to this test's Ray."""
    pids = re.findall(r"asyncrl: ray actor [\w-]+: pid (\d+) on node", log_path.read_text())
    assert pids, f"no actor pid in {log_path}"
    process = psutil.Process(int(pids[-1]))
    assert process.environ().get("RAY_TMPDIR") == str(ray_dir), process.cmdline()
    return process


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
