"""The Ray backend: the run's roles as actors, supervised by the shared policy.

:class:`RayRun` places every actor (:class:`~asyncrl.run.ray.placement.RayActors`),
writes the resolved config to ``RUN_DIR/config.yaml`` for people and hands it
to every role from the driver's memory (``ASYNCRL_CONFIG``,
:func:`asyncrl.run.roles.config_env`), a restarted generator's included, as under
the local launcher, and to each its role's credentials, no other's, as an
argument of the call that runs the role. Then it supervises the roles as the local launcher does
(:class:`asyncrl.run.supervision.Supervision`): a generator whose actor dies or
whose role stops gets a new actor after the back-off, with ``--restarts N``;
the buffer or a learner rank stopping fails the run at once, naming the actor;
the watchdog reads each actor's progress report in ``RUN_DIR/progress/``: a
stalled generator's actor is killed and replaced, a stalled buffer or learner
rank fails the run. At the end (or on Ctrl-C) every role gets SIGTERM in the
policy's order, then every actor is killed.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from typing import TYPE_CHECKING

from asyncrl.config import save_config
from asyncrl.run.ray.placement import Member, RayActors
from asyncrl.run.roles import config_env
from asyncrl.run.supervision import LOG_TAIL_LINES, Replica, Supervision

if TYPE_CHECKING:
    from asyncrl.run.console import RunConsole

TICK_S = 0.2
"""How often the driver looks at its actors and at ``metrics.jsonl``."""
STOP_SLACK_S = 1.5
"""Added to each phase of :func:`~asyncrl.run.supervision.stop_phases`: the SIGTERM goes
through a Ray task on the actor's node."""


class RayRun(RayActors, Supervision):
    """The actors of one run: starting, supervising and stopping them."""

    peers = "actors"

    # ---- start

    def start(self, console: RunConsole) -> None:
        """Place every actor, write the resolved config, start every role."""
        self.place_learner()
        self.create_actors()
        self.config = self.resolve_endpoints()
        save_config(self.config, self.run_dir / "config.yaml")  # for people: no role reads it
        self.hand_out()
        console.note(f"ray: endpoints on {self.config.cluster.host}; {self.placement()}")
        self.run_roles()

    def hand_out(self) -> None:
        """Give every member the config from memory and its role's credentials, no other's
        (docs/security.md); a restarted generator's new actor is handed the same."""
        handed = config_env(self.config)
        for member in self.members:
            member.env |= handed
            if self.credentials is not None:
                member.credentials = self.credentials.for_role(member.role).to_json()

    # ---- supervise

    def supervise(self, console: RunConsole) -> str | None:
        """Watch until every learner rank is done, replacing generators that stop;
        a failure message if the buffer or a learner rank failed."""
        self.notify = self.watchdog.notify = lambda text: console.note(text, True)
        while any(m.name not in self.stopped for m in self.learners()):
            self.requests.check()
            self.restart_generators()
            if (failure := self.check_progress()) is not None:
                return failure
            console.update(self.health())
            running = {m.ref: m for m in self.members if m.ref is not None}
            starting = {m.starting: m for m in self.members if m.starting is not None}
            done, _ = self.ray.wait([*running, *starting], num_returns=1, timeout=TICK_S)
            for ref in done:
                if ref in starting:
                    if (failure := self.started_again(starting[ref])) is not None:
                        return failure
                    continue
                member = running[ref]
                error = self.error_of(ref)
                if member.replica is not None:
                    failure = self.replace_later(member, error or "its role returned")
                    if failure is not None:
                        return failure
                    continue
                member.ref = None
                self.stopped.add(member.name)
                if error is not None:
                    return self.describe(member.name, error)
                if member.role != "learner":
                    return self.describe(member.name, "stopped before the learner finished")
        return None

    def replace_later(self, member: Member, why: str) -> str | None:
        """``member``'s generator stopped: free its actor; a new one follows after the
        back-off, or the run fails
        (:meth:`~asyncrl.run.supervision.Supervision.generator_ended`)."""
        why = why.rstrip(".")
        failure = self.generator_ended(member.replica, "stopped", f" ({why})", fallback=why)
        with contextlib.suppress(Exception):
            self.ray.kill(member.actor)  # a role that returned leaves its actor alive
        member.actor = member.ref = member.starting = member.info = None
        return failure

    def restart_generators(self) -> None:
        """Create the new actor of each generator whose back-off is over."""
        for member in self.members:
            replica = member.replica
            if replica is None or not self.restart_due(replica, time.monotonic()):
                continue
            member.argv = ["generator", str(self.run_dir), *replica.role_args()]
            member.starting = self.new_actor(member)
            replica.started_at = time.monotonic()  # a new actor that fails to start counts

    def started_again(self, member: Member) -> str | None:
        """A generator's new actor is placed: run its role (or try again if it failed)."""
        ref, member.starting = member.starting, None
        if (error := self.error_of(ref)) is not None:
            return self.replace_later(member, f"its new actor could not start: {error}")
        member.info = self.ray.get(ref)
        member.ref = member.actor.run.remote(member.argv, member.env, member.credentials)
        self.watch(member)
        member.replica.started_at = time.monotonic()
        self.notify(
            f"asyncrl: {member.name} started again (restart {member.replica.restarts}) "
            f"on {member.info['ip']}"
        )
        return None

    # the policy's hooks (asyncrl.run.supervision.Supervision)

    def describe(self, name: str, why: str, lines: int = LOG_TAIL_LINES) -> str:
        """``actor NAME on IP: WHY; last lines of LOG:`` and the tail of its log."""
        info = self.member(name).info
        where = f" on {info['ip']}" if info else ""
        message = f"actor {name}{where}: {why}"
        with contextlib.suppress(OSError):  # none on this node, or removed: no tail
            message += f"; last lines of {self.log_path(name)}:\n{self.tail(name, lines)}"
        return message

    def kill_stalled(self, replica: Replica) -> str:
        with contextlib.suppress(Exception):
            self.ray.kill(self.member(replica.name).actor)  # its role's task then fails
        return "killing its actor"

    def is_up(self, replica: Replica) -> bool:
        return self.member(replica.name).actor is not None

    def is_stopped(self, replica: Replica) -> bool:
        return replica.name in self.stopped

    def restarting(self, replica: Replica) -> bool:
        """Waiting out its back-off, or for Ray to place its new actor."""
        return replica.restart_at is not None or self.member(replica.name).starting is not None

    # ---- stop

    def stop(self) -> None:
        """Stop the roles in the policy's order, then kill every actor.

        Generators first (each finishes its chunk), then the learner (it may
        need the buffer on the way out), then the buffer, each by SIGTERM and
        within its phase of :func:`~asyncrl.run.supervision.stop_phases`; a second
        stop signal skips the waits.
        """
        self.requests.stopping = True
        self.stop_in_phases(
            self._running, self._terminate, self._exited, self.requests.hurry, TICK_S, STOP_SLACK_S
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

    def _running(self, role: str) -> list[Member]:
        """``role``'s members whose role still runs (none if Ray cannot say)."""
        members = [
            m
            for m in self.members
            if m.role == role and m.ref is not None and m.name not in self.stopped
        ]
        try:
            return [m for m in members if not self.ray.wait([m.ref], timeout=0)[0]]
        except Exception:
            return []

    def _terminate(self, members: list[Member]) -> None:
        with contextlib.suppress(Exception):
            self.signal(members)

    def _exited(self, members: list[Member], wait_s: float) -> bool:
        refs = [member.ref for member in members]
        if not refs:
            return True
        try:
            _, left = self.ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        except Exception:
            return True
        return not left
