"""``cluster.backend: ray``: the run's roles as Ray actors, placed by the resources they ask for.

The driver (``asyncrl launch`` on a machine of the cluster) joins the Ray
cluster at ``cluster.address``, or starts a local Ray on 127.0.0.1 for this run
and shuts it down at the end. Then:

1. a placement group holds the learner ranks, one bundle per rank
   (``learner.num_cpus_per_rank`` / ``num_gpus_per_rank``, strategy
   ``learner.placement``); bundle 0 also holds the buffer
   (``cluster.buffer_num_cpus``), so the buffer and the weights publisher
   (learner rank 0) share a node and one advertised address serves both;
2. one :class:`~asyncrl.ray_actors.RoleActor` per role: the buffer, each
   learner rank and each generator replica (its pool's ``num_cpus`` /
   ``num_gpus``); each sends its output to ``RUN_DIR/logs/NAME.log`` and
   reports its node;
3. the endpoints are advertised by the buffer's node address (a local Ray:
   ``cluster.host``, since every actor is on this machine); free ports are
   picked on that node; the resolved config is written to
   ``RUN_DIR/config.yaml`` for people, and handed to every role from the
   driver's memory (``ASYNCRL_CONFIG``, :func:`asyncrl.roles.config_env`), a
   restarted generator's included, as under the local launcher; learner ranks
   get their process group's variables (:func:`rank_env`): under a local Ray a
   file store in a private directory, as the local launcher does; on a cluster
   rank 0's node address and a free port there (torch's TCPStore);
4. the roles start; the driver prints progress from ``metrics.jsonl`` and
   waits for the learner. A generator replica whose actor dies or whose role
   stops gets a new actor after the local launcher's back-off, with
   ``--restarts N`` (:class:`asyncrl.launch.Replica`); the buffer or a learner
   rank stopping fails the run at once, naming the actor. As under the local
   launcher, a generator failing the same way at every start fails the run, and
   the watchdog (:mod:`asyncrl.watchdog`) reads each actor's progress report in
   ``RUN_DIR/progress/``: a stalled generator's actor is killed and replaced, a
   stalled buffer or learner rank fails the run. At the end (or on Ctrl-C)
   every role gets SIGTERM, then every actor is killed.

RUN_DIR must be one shared filesystem path on every node (config, logs,
metrics, checkpoints); see docs/ray.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config, save_config
from asyncrl.launch import Replica, closing_message, stop_phases, wrote_final_policy
from asyncrl.paths import replica_name
from asyncrl.ray_actors import RoleActor, terminate
from asyncrl.roles import LEARNER_STORE_ENV, config_env
from asyncrl.watchdog import Watchdog, failure_line

if TYPE_CHECKING:
    from asyncrl.console import ReplicaHealth, RunConsole

TICK_S = 0.2
"""How often the driver looks at its actors and at ``metrics.jsonl``."""
STOP_SLACK_S = 1.5
"""Added to each phase of the local launcher's :func:`~asyncrl.launch.stop_phases`:
the SIGTERM goes through a Ray task on the actor's node."""
LOG_TAIL_LINES = 20
RESTART_TAIL_LINES = 3
"""Log lines shown with a generator's restart note (the run goes on)."""
START_TIMEOUT_S = 300.0
"""How long to wait for Ray to place every actor (a cluster may be scaling up)."""
WAIT_NOTICE_S = 15.0
"""After this long waiting for placement, say what is still pending."""
OBJECT_STORE_BYTES = 200 * 1024**2
"""A local Ray's object store: the roles move their data over ZeroMQ, not through Ray."""
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
"""Set (unless already set) before importing ray: a local Ray then lives on 127.0.0.1
rather than on this machine's network address (Ray's own switch for single-machine
instances), with the token authentication Ray enables by default, minus its warning."""


class RayLaunchError(RuntimeError):
    """The run cannot be placed or started; the message names the config key or actor."""


@dataclass
class Member:
    """One actor of the run and the role it holds."""

    name: str
    argv: list[str]
    options: dict[str, Any]
    """``ray.remote`` options: resources and scheduling strategy."""
    env: dict[str, str] = field(default_factory=dict)
    actor: Any = None
    info: dict[str, Any] | None = None
    """``ip``, ``node_id`` and ``pid``, once the actor has started."""
    replica: Replica | None = None
    """A generator's slot: pool, index, restarts and back-off (shared with the local
    launcher); the actor in it is replaced when it stops."""
    ref: Any = None
    """The running role's ObjectRef."""
    starting: Any = None
    """A replacement actor's ``start`` ObjectRef, until Ray has placed it."""

    @property
    def role(self) -> str:
        return self.argv[0]

    @property
    def asks(self) -> str:
        cpus, gpus = self.options.get("num_cpus", 0), self.options.get("num_gpus", 0)
        return f"{cpus:g} CPU" + (f", {gpus:g} GPU" if gpus else "")


# --------------------------------------------------------------------------
# the plan: pure functions of the config


def check_resources(config: Config) -> list[str]:
    """Settings that cannot work under Ray, one message each naming the keys."""
    problems = []
    learner = config.learner
    if learner.device == "cuda" and learner.num_gpus_per_rank == 0:
        problems.append(
            "learner.device=cuda with cluster.backend=ray needs learner.num_gpus_per_rank > 0: "
            "Ray hides GPUs from actors that do not ask for them"
        )
    reserved = sorted(set(learner.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
    if reserved:
        problems.append(
            f"learner.resources names {reserved}: ask for CPUs and GPUs with "
            "learner.num_cpus_per_rank and learner.num_gpus_per_rank"
        )
    if learner.num_gpus_per_rank > 1:
        problems.append(
            f"learner.num_gpus_per_rank={learner.num_gpus_per_rank:g}: a learner rank uses "
            "one GPU; run more ranks (learner.world_size) instead"
        )
    return problems


def learner_bundles(config: Config) -> list[dict[str, float]]:
    """One bundle per learner rank; bundle 0 also holds the buffer."""
    learner = config.learner
    bundles = []
    for rank in range(learner.world_size):
        cpus = learner.num_cpus_per_rank + (config.cluster.buffer_num_cpus if rank == 0 else 0)
        bundle = {"CPU": cpus, **learner.resources}
        if learner.num_gpus_per_rank:
            bundle["GPU"] = learner.num_gpus_per_rank
        bundles.append(bundle)
    return bundles


def generator_replicas(config: Config) -> list[tuple[str, str, int, float, float]]:
    """``(name, pool, index, num_cpus, num_gpus)`` of every generator replica."""
    replicas = []
    for pool in config.generators.resolved_pools():
        for index in range(pool.replicas):
            replicas.append(
                (replica_name(pool.name, index), pool.name, index, pool.settings.num_cpus,
                 pool.settings.num_gpus)
            )  # fmt: skip
    return replicas


def local_num_cpus(config: Config) -> int:
    """CPUs a local Ray offers: exactly what the run asks for (Ray's CPUs are logical)."""
    asked = sum(bundle["CPU"] for bundle in learner_bundles(config))
    asked += sum(cpus for *_, cpus, _ in generator_replicas(config))
    return max(1, math.ceil(asked))


def local_resources(config: Config) -> dict[str, float]:
    """Custom resources a local Ray offers: what the learner ranks ask for."""
    learner = config.learner
    return {key: value * learner.world_size for key, value in learner.resources.items()}


def advertise(config: Config, host: str, ports: dict[str, int]) -> Config:
    """``config`` with the endpoints' address and ports as every role must see them."""
    update = {"host": host, **ports}
    return config.model_copy(update={"cluster": config.cluster.model_copy(update=update)})


def rank_env(
    rank: int,
    world_size: int,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: Path | None = None,
) -> dict[str, str]:
    """A learner rank's process-group variables (:func:`asyncrl.learner.distributed.init`).

    One rank needs no more than these (its store lives in its process); ranks
    on one machine meet through the file ``store``; ranks across nodes through
    torch's TCPStore at ``master_addr:master_port``. ``LOCAL_RANK`` is 0: Ray
    gives each actor only its own GPUs, so a rank's GPU is always device 0 of
    those it sees.
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    if store is not None:
        env[LEARNER_STORE_ENV] = str(store)
    if master_addr is not None:
        env |= {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    return env


# --------------------------------------------------------------------------
# the driver


def launch_ray(
    config: Config, run_dir: Path, resume_from: Path | None = None, quiet: bool = False
) -> int:
    """Run to completion on Ray; returns the exit status for the command line."""
    from asyncrl.console import open_console

    problems = check_resources(config)
    if problems:
        print(f"asyncrl: cannot run on Ray ({len(problems)} problem(s)):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    run_dir = run_dir.resolve()
    try:
        ray = _connect(config)
    except RayLaunchError as error:
        print(f"asyncrl: {error}", file=sys.stderr, flush=True)
        return 1
    started = time.time()
    failure: str | None = None
    try:
        with open_console(config, run_dir, quiet) as console:
            console.note(f"run dir: {run_dir}")
            if resume_from is not None:
                console.note(f"resuming from {resume_from}")
            with StopRequests() as requests:
                run = RayRun(ray, config, run_dir, resume_from, requests)
                try:
                    run.start(console)
                    failure = run.supervise(console)
                    status = 0 if failure is None else 1
                except RayLaunchError as error:
                    failure, status = str(error), 1
                except Stopping as stopping:
                    console.note(f"asyncrl: {stopping}: stopping every actor", error=True)
                    status = 128 + stopping.signum
                except Exception as error:  # the driver's own fault: stop every actor, say so
                    console.note(traceback.format_exc().rstrip(), error=True)
                    failure, status = f"the launcher failed while supervising: {error!r}", 1
                finally:
                    run.stop()
            console.update(run.health())  # the steps logged while stopping
            if status == 0 and not wrote_final_policy(run_dir, started):
                failure, status = "the learner stopped before run.total_steps without an error", 1
            message = closing_message(run_dir, status, failure, time.time() - started)
            console.note(message, error=status != 0)
    finally:
        ray.shutdown()
    return status


def _connect(config: Config) -> Any:
    """Join ``cluster.address``, or start a local Ray (on 127.0.0.1) offering what this run
    asks for: its CPUs and the learner's custom resources."""
    address = config.cluster.address
    if address is None:
        for key, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(key, value)
    import logging

    import ray

    if address is None:
        cpus = local_num_cpus(config)
        ray.init(
            address="local",
            num_cpus=cpus,
            resources=local_resources(config),
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
        print(f"ray: started a local Ray for this run ({cpus} CPUs)", flush=True)
    else:
        print(f"ray: joining the cluster at {address}", flush=True)
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise RayLaunchError(
                f"cannot join the Ray cluster at cluster.address={address}: {error}"
            ) from None
        resources = ray.cluster_resources()
        print(
            f"ray: joined: {resources.get('CPU', 0):g} CPUs, "
            f"{resources.get('GPU', 0):g} GPUs on {len(ray.nodes())} node(s)",
            flush=True,
        )
    return ray


class Stopping(Exception):
    """A stop signal came: raised by the driver's own loops, never inside a Ray call."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequests:
    """SIGINT, SIGTERM and SIGHUP stop the run: the first one is recorded for the
    driver's loops to act on (an exception raised by the handler inside a Ray call
    would surface as a SystemError); later ones ask the stop to hurry."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopping = False
        """Set when the stop begins: from then on a signal only hurries it."""
        self.hurried = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequests:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None and not self.stopping:
            self.signum = signum
        else:
            self.hurried = True

    def check(self) -> None:
        """Raise :class:`Stopping` once a stop signal has come."""
        if self.signum is not None:
            raise Stopping(self.signum)

    def hurry(self) -> bool:
        return self.hurried


class RayRun:
    """The actors of one run: placing, starting, supervising and stopping them."""

    def __init__(
        self,
        ray: Any,
        config: Config,
        run_dir: Path,
        resume_from: Path | None,
        requests: StopRequests,
    ):
        self.ray = ray
        self.requests = requests
        self.config = config
        self.run_dir = run_dir
        self.resume = ["--resume-from", str(resume_from.resolve())] if resume_from else []
        self.members: list[Member] = []
        self.placement_group: Any = None
        self.stopped: set[str] = set()
        """Members whose role has returned or failed, and is not being restarted."""
        self.cwd = os.getcwd()
        self.remote: Any = None
        """``RoleActor`` as a Ray actor class."""
        self.store_dir: Path | None = None
        """The private directory of the learner ranks' file store (a local Ray, > 1 rank)."""
        self.watchdog = Watchdog(run_dir, config.run.stall_timeout_s)
        """Which role made no progress for ``run.stall_timeout_s`` (:mod:`asyncrl.watchdog`)."""
        self.driver_node: str | None = None
        """This driver's Ray node: its actors' progress reports are in this run directory."""

    # ---- start

    def start(self, console: RunConsole) -> None:
        """Place every actor, write the resolved config, start every role."""
        self.place_learner()
        self.create_actors()
        self.config = self.resolve_endpoints()
        save_config(self.config, self.run_dir / "config.yaml")  # for people: no role reads it
        handed = config_env(self.config)  # restarts reuse member.env: the config from memory
        for member in self.members:
            member.env |= handed
        console.note(f"ray: endpoints on {self.config.cluster.host}; {self.placement()}")
        self.run_roles()

    def run_roles(self) -> None:
        """Start every actor's role; a generator's uptime counts from here."""
        with contextlib.suppress(Exception):  # a scripted Ray in tests has no context
            self.driver_node = self.ray.get_runtime_context().get_node_id()
        for member in self.members:
            member.ref = member.actor.run.remote(member.argv, member.env)
            self.watch(member)
            if member.replica is not None:
                member.replica.started_at = time.monotonic()

    def watch(self, member: Member) -> None:
        """Have the watchdog follow ``member``'s actor process (its role runs in it)."""
        info = member.info or {}
        local = self.driver_node is None or info.get("node_id") in (None, self.driver_node)
        self.watchdog.watch(member.name, member.role, info.get("pid"), local=local)

    def placement(self) -> str:
        """Which actors each node got: ``node IP (id): names; ...``."""
        nodes: dict[tuple[str, str], list[str]] = {}
        for member in self.members:
            if member.info is not None:
                key = (member.info["ip"], member.info["node_id"][:6])
                nodes.setdefault(key, []).append(member.name)
        return "; ".join(
            f"node {ip} ({id_}): {', '.join(names)}" for (ip, id_), names in nodes.items()
        )

    def place_learner(self) -> None:
        from ray.util.placement_group import placement_group

        bundles = learner_bundles(self.config)
        strategy = self.config.learner.placement
        self.placement_group = placement_group(bundles, strategy=strategy)
        what = (
            f"the learner's placement group ({len(bundles)} bundle(s) {bundles}, {strategy}; "
            "learner.num_cpus_per_rank, learner.num_gpus_per_rank, learner.resources, "
            "cluster.buffer_num_cpus)"
        )
        self.wait_placed({self.placement_group.ready(): what})

    def create_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def in_bundle(index: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            )

        run_dir, learner = str(self.run_dir), self.config.learner
        buffer_cpus = self.config.cluster.buffer_num_cpus
        self.members.append(
            Member(
                "buffer",
                ["buffer", run_dir, *self.resume],
                {"num_cpus": buffer_cpus, "scheduling_strategy": in_bundle(0)},
            )
        )
        for rank in range(learner.world_size):
            self.members.append(
                Member(
                    f"learner-{rank}" if learner.world_size > 1 else "learner",
                    ["learner", run_dir, *self.resume],
                    {
                        "num_cpus": learner.num_cpus_per_rank,
                        "num_gpus": learner.num_gpus_per_rank,
                        "scheduling_strategy": in_bundle(rank),
                    },
                )
            )
        for name, pool, index, cpus, gpus in generator_replicas(self.config):
            replica = Replica(name, pool, index)
            argv = ["generator", run_dir, *replica.role_args()]
            options = {"num_cpus": cpus, "num_gpus": gpus}
            self.members.append(Member(name, argv, options, replica=replica))
        self.remote = self.ray.remote(RoleActor)
        starting = {}
        for member in self.members:
            starting[self.new_actor(member)] = f"{member.name} ({member.asks})"
        for member, info in zip(self.members, self.wait_placed(starting), strict=True):
            member.info = info

    def new_actor(self, member: Member) -> Any:
        """Create ``member``'s actor; the ObjectRef of its ``start`` (where it landed)."""
        member.actor = self.remote.options(**member.options).remote()
        return member.actor.start.remote(str(self.run_dir), member.name, self.cwd)

    def wait_placed(self, pending: dict[Any, str]) -> list[Any]:
        """Results of ``pending`` refs, each labelled with what it waits for."""
        started = time.monotonic()
        noticed = False
        remaining = dict(pending)
        while remaining:
            self.requests.check()
            waited = time.monotonic() - started
            if waited > START_TIMEOUT_S:
                raise RayLaunchError(
                    f"Ray could not place within {START_TIMEOUT_S:.0f}s: "
                    + "; ".join(remaining.values())
                    + f". The cluster has {self._resources()}"
                )
            if waited > WAIT_NOTICE_S and not noticed:
                noticed = True
                print(
                    f"ray: waiting for resources for {'; '.join(remaining.values())} "
                    f"(cluster: {self._resources()})",
                    file=sys.stderr,
                    flush=True,
                )
            done, _ = self.ray.wait(list(remaining), num_returns=len(remaining), timeout=1.0)
            for ref in done:
                if (error := self.error_of(ref)) is not None:
                    raise RayLaunchError(f"{remaining[ref]} could not start: {error}")
                del remaining[ref]
        return self.ray.get(list(pending))

    def _resources(self) -> str:
        available = self.ray.available_resources()
        total = self.ray.cluster_resources()
        return ", ".join(
            f"{available.get(key, 0):g}/{total[key]:g} {key} free"
            for key in ("CPU", "GPU")
            if key in total
        )

    def resolve_endpoints(self) -> Config:
        """The config every role reads: advertised address, free ports, rank variables."""
        buffer, ranks = self.members[0], self.learners()
        cluster = self.config.cluster
        host = cluster.host if cluster.address is None else buffer.info["ip"]
        wanted = [key for key in ("buffer_port", "weights_port") if not getattr(cluster, key)]
        picked = self.ray.get(buffer.actor.free_ports.remote(host, len(wanted)))
        config = advertise(self.config, host, dict(zip(wanted, picked, strict=True)))
        size = len(ranks)
        if size == 1:
            envs = [rank_env(0, 1)]
        elif cluster.address is None:  # a local Ray: every rank on this machine
            self.store_dir = Path(tempfile.mkdtemp(prefix="asyncrl-learner-"))  # mode 0700
            envs = [rank_env(rank, size, store=self.store_dir / "store") for rank in range(size)]
        else:
            master = ranks[0].info["ip"]
            (master_port,) = self.ray.get(ranks[0].actor.free_ports.remote(master, 1))
            envs = [rank_env(rank, size, master, master_port) for rank in range(size)]
        for member, env in zip(ranks, envs, strict=True):
            member.env = env
        return _with_keys(config, self.run_dir)

    # ---- supervise

    def learners(self) -> list[Member]:
        return [m for m in self.members if m.role == "learner"]

    def supervise(self, console: RunConsole) -> str | None:
        """Watch until every learner rank is done, replacing generators that stop;
        a failure message if the buffer or a learner rank failed."""
        self.watchdog.notify = lambda text: console.note(text, True)
        while any(m.name not in self.stopped for m in self.learners()):
            self.requests.check()
            self.restart_due()
            if (failure := self.check_progress(console)) is not None:
                return failure
            console.update(self.health())
            running = {m.ref: m for m in self.members if m.ref is not None}
            starting = {m.starting: m for m in self.members if m.starting is not None}
            done, _ = self.ray.wait([*running, *starting], num_returns=1, timeout=TICK_S)
            for ref in done:
                if ref in starting:
                    if (failure := self.started_again(starting[ref], console)) is not None:
                        return failure
                    continue
                member = running[ref]
                error = self.error_of(ref)
                if member.replica is not None:
                    failure = self.replace_later(member, error or "its role returned", console)
                    if failure is not None:
                        return failure
                    continue
                member.ref = None
                self.stopped.add(member.name)
                if error is not None:
                    return self.describe(member, error)
                if member.role != "learner":
                    return self.describe(member, "stopped before the learner finished")
        return None

    def replace_later(self, member: Member, why: str, console: RunConsole) -> str | None:
        """``member``'s generator stopped: free its actor, schedule a new one after the
        back-off (:meth:`asyncrl.launch.Replica.schedule_restart`); a failure message
        instead once it failed the same way at every start (``Replica.exited``)."""
        replica = member.replica
        now = time.monotonic()
        uptime = now - replica.started_at
        made_progress = self.watchdog.made_progress(member.name)
        self.watchdog.forget(member.name)
        line = failure_line(self.log_path(member), why.rstrip("."))
        failure = None
        if replica.exited(made_progress, uptime, line):
            failure = self.describe(member, replica.failures.describe())
            failure += self.watchdog.others(member.name, "actors")
        else:
            delay = replica.schedule_restart(now)
            stopped = (
                f"stopped after {uptime:.1f}s ({why.rstrip('.')}); restarting it in {delay:.0f}s"
            )
            console.note(f"asyncrl: {self.describe(member, stopped, RESTART_TAIL_LINES)}", True)
        with contextlib.suppress(Exception):
            self.ray.kill(member.actor)  # a role that returned leaves its actor alive
        member.actor = member.ref = member.starting = member.info = None
        return failure

    def check_progress(self, console: RunConsole) -> str | None:
        """Act on the watchdog: a stalled buffer or learner rank fails the run (the
        message); a stalled generator's actor is killed, and replaced as any that stops."""
        if any(self.restarting(m) for m in self.members):
            self.watchdog.generators_restarting()  # the learner's batch waits on it
        stalls = self.watchdog.check()  # the learner's or buffer's first: a generator
        for stall in sorted(stalls, key=lambda s: s.role == "generator"):  # may wait on it
            member = next((m for m in self.members if m.name == stall.name), None)
            if member is None:
                continue
            if member.replica is None:
                return stall.describe() + self.watchdog.others(stall.name, "actors")
            if member.replica.stall is None and member.actor is not None:
                member.replica.stall = stall
                console.note(f"asyncrl: {stall.describe()}; killing its actor", True)
                with contextlib.suppress(Exception):
                    self.ray.kill(member.actor)  # its role's task then fails: replaced
        return None

    def restart_due(self) -> None:
        """Create the new actor of each generator whose back-off is over."""
        for member in self.members:
            replica = member.replica
            if replica is None or replica.restart_at is None:
                continue
            if time.monotonic() < replica.restart_at:
                continue
            replica.restart_at = None
            replica.restarts += 1
            replica.mark_restart(self.log_path(member))
            member.argv = ["generator", str(self.run_dir), *replica.role_args()]
            member.starting = self.new_actor(member)
            replica.started_at = time.monotonic()  # a new actor that fails to start counts

    def started_again(self, member: Member, console: RunConsole) -> str | None:
        """A generator's new actor is placed: run its role (or try again if it failed)."""
        ref, member.starting = member.starting, None
        if (error := self.error_of(ref)) is not None:
            return self.replace_later(member, f"its new actor could not start: {error}", console)
        member.info = self.ray.get(ref)
        member.ref = member.actor.run.remote(member.argv, member.env)
        self.watch(member)
        member.replica.started_at = time.monotonic()
        console.note(
            f"asyncrl: {member.name} started again (restart {member.replica.restarts}) "
            f"on {member.info['ip']}",
            True,
        )
        return None

    @staticmethod
    def restarting(member: Member) -> bool:
        """A generator waiting out its back-off, or for Ray to place its new actor."""
        replica = member.replica
        return replica is not None and (
            replica.restart_at is not None or member.starting is not None
        )

    def health(self) -> list[ReplicaHealth]:
        from asyncrl.console import ReplicaHealth

        def state(member: Member) -> str:
            if member.name in self.stopped:
                return "stopped"
            if self.restarting(member):
                return "restarting"
            return "alive"

        return [
            ReplicaHealth(m.replica.pool, m.name, state(m), m.replica.restarts)
            for m in self.members
            if m.replica is not None
        ]

    def error_of(self, ref: Any) -> str | None:
        """None if ``ref``'s task succeeded, else its error in a line."""
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if cause is not None:
                return f"{type(cause).__name__}: {cause}"
            return _last_line(str(error))
        except self.ray.exceptions.RayError as error:
            return str(error).strip().splitlines()[0]
        return None

    def log_path(self, member: Member) -> Path:
        return self.run_dir / "logs" / f"{member.name}.log"

    def describe(self, member: Member, why: str, lines: int = LOG_TAIL_LINES) -> str:
        """``actor NAME on IP: WHY; last lines of LOG:`` and the tail of its log."""
        where = f" on {member.info['ip']}" if member.info else ""
        log_path = self.log_path(member)
        message = f"actor {member.name}{where}: {why}"
        with contextlib.suppress(OSError):  # none on this node, or removed: no tail
            text = log_path.read_text(errors="replace").splitlines()[-lines:]
            tail = "\n".join("    " + line for line in text)
            message += f"; last lines of {log_path}:\n{tail}"
        return message

    # ---- stop

    def stop(self) -> None:
        """Stop the roles in the local launcher's order, then kill every actor.

        Generators first (each finishes its chunk), then the learner (it may
        need the buffer on the way out), then the buffer, each by SIGTERM and
        within its phase of :func:`~asyncrl.launch.stop_phases`; a second stop signal skips
        the waits.
        """
        self.requests.stopping = True
        begun = time.monotonic()
        for member in self.members:
            if member.replica is not None:
                member.replica.restart_at = None  # no restarts from here on
        for role, by_s in stop_phases(self.config, STOP_SLACK_S):
            members = [
                m
                for m in self.members
                if m.role == role and m.ref is not None and m.name not in self.stopped
            ]
            with contextlib.suppress(Exception):
                members = [m for m in members if not self.ray.wait([m.ref], timeout=0)[0]]
                self.signal(members)
                refs = [m.ref for m in members]
                while refs and not self.requests.hurry():
                    timeout = begun + by_s - time.monotonic()
                    if timeout <= 0:
                        break
                    _, refs = self.ray.wait(
                        refs, num_returns=len(refs), timeout=min(timeout, TICK_S)
                    )
        for member in self.members:
            self.stopped.add(member.name)
            if member.actor is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(member.actor)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement_group)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def signal(self, members: list[Member]) -> None:
        """SIGTERM ``members``' processes, through one small task on each of their nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_node: dict[str, list[int]] = {}
        for member in members:
            if member.info is not None:
                by_node.setdefault(member.info["node_id"], []).append(member.info["pid"])
        task = self.ray.remote(num_cpus=0)(terminate)
        for node_id, pids in by_node.items():
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            task.options(scheduling_strategy=strategy).remote(pids)


def _with_keys(config: Config, run_dir: Path) -> Config:
    """Check the CURVE keys an endpoint beyond loopback needs (docs/security.md)."""
    from asyncrl.security import resolve_keys

    return resolve_keys(config, run_dir)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
