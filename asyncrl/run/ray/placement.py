"""The actors of a run on Ray: placed by the resources they ask for, and where they landed.

1. a placement group holds the learner ranks, one bundle per rank
   (``learner.num_cpus_per_rank`` / ``num_gpus_per_rank``, strategy
   ``learner.placement``); bundle 0 also holds the buffer
   (``cluster.buffer_num_cpus``), so the buffer and the weights publisher
   (learner rank 0) share a node and one advertised address serves both;
2. one :class:`~asyncrl.run.ray.actors.RoleActor` per role: the buffer, each
   learner rank and each generator replica (its pool's ``num_cpus`` /
   ``num_gpus``); each sends its output to ``RUN_DIR/logs/NAME.log`` and
   reports its node;
3. the endpoints are advertised by the buffer's node address (a local Ray:
   ``cluster.host``, since every actor is on this machine); free ports are
   picked on that node; learner ranks get their process group's variables
   (:func:`~asyncrl.run.ray.plan.rank_env`): under a local Ray a file store in a
   private directory, as the local launcher does; on a cluster rank 0's node
   address and a free port there (torch's TCPStore).

Running and supervising the roles is :class:`asyncrl.run.ray.run.RayRun`'s.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.core.credentials import Credentials
from asyncrl.core.stop_signals import StopSignals
from asyncrl.core.waiting import Waited, wait_with_stop
from asyncrl.run.closing import LaunchError
from asyncrl.run.ray.actors import RoleActor, terminate
from asyncrl.run.ray.plan import advertise, generator_replicas, learner_bundles, rank_env
from asyncrl.run.supervision import Replica
from asyncrl.run.watchdog import Watchdog

START_TIMEOUT_S = 300.0
"""How long to wait for Ray to place every actor (a cluster may be scaling up)."""
WAIT_NOTICE_S = 15.0
"""After this long waiting for placement, say what is still pending."""
PLACE_POLL_S = 1.0
"""How often a wait for placement looks for a stop signal."""


class RayLaunchError(LaunchError):
    """The run cannot be placed or started; the message names the config key or actor."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Member:
    """One actor of the run and the role it holds."""

    name: str
    argv: list[str]
    options: dict[str, Any]
    """``ray.remote`` options: resources and scheduling strategy."""
    env: dict[str, str] = field(default_factory=dict)
    credentials: str | None = None
    """Its role's credentials (JSON), an argument of the call that runs the role: the
    learner's reach the learner's actors alone, and are in no file."""
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


class RayActors:
    """The actors of one run: placing them, where each landed, running their roles under
    the watchdog; supervising them is :class:`~asyncrl.run.ray.run.RayRun`'s."""

    def __init__(
        self,
        ray: Any,
        config: Config,
        run_dir: Path,
        resume_from: Path | None,
        requests: StopSignals,
        credentials: Credentials | None = None,
    ):
        self.ray = ray
        self.credentials = credentials
        """The run's credentials; each actor is handed its role's share."""
        self.requests = requests
        """The driver's stop signals: a wait for placement ends on one."""
        self.config = config
        self.run_dir = run_dir
        self.resume = ["--resume-from", str(resume_from.resolve())] if resume_from else []
        self.members: list[Member] = []
        self.replicas: dict[str, Replica] = {}
        """The generators' slots, by name (each also on its member)."""
        self.placement_group: Any = None
        self.cwd = os.getcwd()
        self.remote: Any = None
        """``RoleActor`` as a Ray actor class."""
        self.store_dir: Path | None = None
        """The private directory of the learner ranks' file store (a local Ray, > 1 rank)."""
        self.stopped: set[str] = set()
        """Members whose role has returned or failed, and is not being restarted."""
        self.watchdog = Watchdog(run_dir, config.run.stall_timeout_s)
        """Which role made no progress for ``run.stall_timeout_s`` (:mod:`asyncrl.run.watchdog`)."""
        self.driver_node: str | None = None
        """This driver's Ray node: its actors' progress reports are in this run directory."""
        self.notify: Callable[[str], None] = _stderr
        """Where events are said (the console's, once supervising)."""

    def run_roles(self) -> None:
        """Start every actor's role; a generator's uptime counts from here."""
        with contextlib.suppress(Exception):  # a scripted Ray in tests has no context
            self.driver_node = self.ray.get_runtime_context().get_node_id()
        for member in self.members:
            member.ref = member.actor.run.remote(member.argv, member.env, member.credentials)
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
            self.replicas[name] = replica
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

        def placed(wait_s: float) -> bool:
            nonlocal noticed
            if not remaining:
                return True
            if time.monotonic() - started > WAIT_NOTICE_S and not noticed:
                noticed = True
                _stderr(
                    f"ray: waiting for resources for {'; '.join(remaining.values())} "
                    f"(cluster: {self._resources()})"
                )
            done, _ = self.ray.wait(list(remaining), num_returns=len(remaining), timeout=wait_s)
            for ref in done:
                if (error := self.error_of(ref)) is not None:
                    raise RayLaunchError(f"{remaining[ref]} could not start: {error}")
                del remaining[ref]
            return not remaining

        waited = wait_with_stop(placed, START_TIMEOUT_S, self.requests, PLACE_POLL_S)
        self.requests.check()  # a stop signal: Interrupted
        if waited is Waited.TIMED_OUT:
            raise RayLaunchError(
                f"Ray could not place within {START_TIMEOUT_S:.0f}s: "
                + "; ".join(remaining.values())
                + f". The cluster has {self._resources()}"
            )
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
        weights = self.config.weights
        if weights.transport == "collective" and not weights.group_port:
            wanted.append("group_port")  # the learner's group store, on the buffer's node too
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

    def learners(self) -> list[Member]:
        return [m for m in self.members if m.role == "learner"]

    def member(self, name: str) -> Member:
        return next(member for member in self.members if member.name == name)

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
    from asyncrl.core.security import resolve_keys

    return resolve_keys(config, run_dir)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
