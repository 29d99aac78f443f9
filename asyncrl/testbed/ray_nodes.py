"""A Ray cluster across test hosts: the head on one, a worker node on each of the others.

Each node is a ``ray start`` inside its host's namespace, bound to that host's
address and offering only the CPUs and custom resources it is given, so Ray's
placement is as real as across machines. The nodes share one token
(``RAY_AUTH_MODE=token``, a token file of the bed's own) and one temporary
folder of the bed's own; the bed ends their processes by pid with the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.testbed.hosts import TestBed, end_processes

GCS_PORT = 6379
OBJECT_STORE_BYTES = 96 * 1024**2
"""Each node's object store: the runs move their data over ZeroMQ, not through Ray
(Ray's floor is 75 MiB)."""
START_TIMEOUT_S = 120.0
WORKER_PORTS = (23000, 23999)
"""Where Ray's workers (the actors' processes) listen for Ray's own calls: a known range,
so a test can tell those listeners from any a role opens."""


@dataclass(frozen=True)
class NodeSpec:
    """What one host's Ray node offers."""

    num_cpus: float
    resources: Mapping[str, float] = field(default_factory=dict)


class RayNodes:
    """Ray on a bed: ``start`` the nodes, hand :attr:`env` to every process that joins."""

    def __init__(
        self,
        bed: TestBed,
        nodes: Mapping[str, NodeSpec],
        *,
        head: str | None = None,
        system_env: Mapping[str, str] | None = None,
    ) -> None:
        self.bed = bed
        self.nodes = dict(nodes)
        self.head = head or next(iter(self.nodes))
        if self.head not in self.nodes:
            raise ValueError(f"the head {self.head!r} is not among the nodes {list(self.nodes)}")
        self.folder = Path(tempfile.mkdtemp(prefix="arl-ray-"))  # short: Ray's socket paths
        token = self.folder / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            **(system_env or {}),
        }
        self.ray = str(Path(sys.executable).with_name("ray"))

    @property
    def address(self) -> str:
        """The head's GCS address, for ``cluster.address``."""
        return f"{self.bed[self.head].address}:{GCS_PORT}"

    def start(self) -> None:
        """Start the head, then every worker node, and wait until all have joined."""
        order = [self.head, *(name for name in self.nodes if name != self.head)]
        for name in order:
            self._start_node(name, head=name == self.head)
        self.wait_for_nodes(len(order))

    def _start_node(self, name: str, *, head: bool) -> None:
        spec = self.nodes[name]
        host = self.bed[name]
        argv = [
            self.ray, "start",
            f"--node-ip-address={host.address}",
            f"--num-cpus={spec.num_cpus:g}",
            "--num-gpus=0",
            f"--resources={json.dumps(dict(spec.resources))}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--temp-dir={self.folder}",
            f"--min-worker-port={WORKER_PORTS[0]}",
            f"--max-worker-port={WORKER_PORTS[1]}",
            "--disable-usage-stats",
        ]
        if head:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        done = host.run(argv, env=self.env, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(
                f"ray start on host {name} ({host.address}) failed:\n{done.stdout[-2000:]}"
                f"\n{done.stderr[-2000:]}"
            )

    def alive_nodes(self) -> list[str]:
        """The addresses of the nodes the head counts as alive."""
        script = (
            f"import json, ray; ray.init(address='{self.address}', logging_level='ERROR');"
            "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
        )
        done = self.bed[self.head].run([sys.executable, "-c", script], env=self.env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"cannot ask the head for its nodes: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def wait_for_nodes(self, count: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.alive_nodes()
            if len(alive) >= count:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(alive)} of {count} Ray nodes joined: {alive}")
            time.sleep(1.0)

    def stop(self) -> None:
        """End every node's processes (by the pids of their hosts' namespaces)."""
        for name in self.nodes:
            end_processes(self.bed[name].netns)
        shutil.rmtree(self.folder, ignore_errors=True)
