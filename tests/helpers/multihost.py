"""A Ray cluster on three test hosts and a run launched on it, for the multi-host tests and
``benchmarks/multihost.py``.

Host ``a`` is the head: it offers the buffer's and the learner's CPUs and the custom
resource ``learner_node`` the learner asks for, so both land there; hosts ``b`` and
``c`` offer one CPU each, so each takes one generator replica. Every host has its own
address, network stack and ``/dev/shm``; the run directory is shared (one machine), as
docs/ray.md asks of a real cluster.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncrl.run.status import read_metrics
from asyncrl.testbed.hosts import TestBed
from asyncrl.testbed.ray_nodes import NodeSpec, RayNodes

REPO = Path(__file__).resolve().parents[2]
ASYNCRL = str(REPO / ".venv" / "bin" / "asyncrl")
LAYOUT = {"a": NodeSpec(2, {"learner_node": 1}), "b": NodeSpec(1), "c": NodeSpec(1)}
ON_THE_HEAD = ("cluster.backend=ray", "learner.resources={learner_node: 1}", "tracking.aim=false")
POLL_S = 0.2


@dataclass
class Cluster:
    bed: TestBed
    nodes: RayNodes

    def launch(self, run_dir: Path, *overrides: str, config: str = "configs/quickstart.yaml"):
        """``asyncrl launch`` on the head host, joining the cluster; its output in
        ``run_dir.parent / (run_dir.name + ".out")``."""
        subprocess.run([ASYNCRL, "keys", str(run_dir)], check=True, capture_output=True)
        out = run_dir.parent / f"{run_dir.name}.out"
        argv = [
            ASYNCRL, "launch", config, "--run-dir", str(run_dir), "--quiet",
            *ON_THE_HEAD, f"cluster.address={self.nodes.address}", *overrides,
        ]  # fmt: skip
        with out.open("w") as sink:
            process = self.bed["a"].popen(
                argv, env=self.nodes.env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
            )
        return Launch(process, run_dir, out)


@contextlib.contextmanager
def cluster(
    shaped: Sequence[str] = (),
    system_env: dict[str, str] | None = None,
    layout: dict[str, NodeSpec] | None = None,
) -> Iterator[Cluster]:
    """Hosts with Ray on them (by default :data:`LAYOUT`: three); everything ended and
    deleted however the block ends."""
    layout = layout or LAYOUT
    with TestBed(tuple(layout), shaped=shaped) as bed:
        nodes = RayNodes(bed, layout, system_env=system_env)
        try:
            nodes.start()
            yield Cluster(bed, nodes)
        finally:
            nodes.stop()


@dataclass
class Launch:
    process: subprocess.Popen
    run_dir: Path
    out: Path

    def records(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def steps(self) -> int:
        return len(self.records())

    def until(self, what: str, done, timeout_s: float = 300.0) -> float:
        """Wait for ``done()``; the time it became true (``time.time``)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.process.poll() is not None:
                raise AssertionError(f"the run ended ({self.process.returncode}) before {what}:"
                                     f"\n{self.output()[-3000:]}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} in {timeout_s:.0f}s:\n{self.output()[-3000:]}")
            time.sleep(POLL_S)
        return time.time()

    def wait_for_step(self, step: int, timeout_s: float = 300.0) -> float:
        return self.until(f"step {step}", lambda: self.steps() >= step, timeout_s)

    def wait(self, timeout_s: float = 600.0) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tail = self.output()[-3000:]
            raise AssertionError(f"the run outlived {timeout_s:.0f}s:\n{tail}") from None

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def log(self, role: str) -> str:
        path = self.run_dir / "logs" / f"{role}.log"
        return path.read_text() if path.exists() else ""

    def placement(self) -> dict[str, list[str]]:
        """Node address -> the actors the driver says landed there."""
        line = next(
            (line for line in self.output().splitlines() if line.startswith("ray: endpoints on")),
            "",
        )
        return {
            address: [name.strip() for name in names.split(",")]
            for address, names in re.findall(r"node ([\d.]+) \(\w+\): ([\w, -]+)", line)
        }

    def generator_on(self, address: str) -> str:
        """The generator id (``gen-N``) of the one replica on ``address``."""
        (name,) = [n for n in self.placement()[address] if n.startswith("generator-")]
        return "gen-" + name.rsplit("-", 1)[1]


def logged_at(text: str, pattern: str) -> float | None:
    """The time (``time.time``) of the first log line matching ``pattern``, None if none."""
    for line in text.splitlines():
        if re.search(pattern, line):
            stamp = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
            return time.mktime(stamp) + int(line[20:23]) / 1000
    return None
