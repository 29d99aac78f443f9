"""What ``asyncrl launch`` shows while a run goes, fed from ``RUN_DIR/metrics.jsonl``.

Two views with one interface (``update``, ``note``, ``close``), chosen by
:func:`open_console`:

- :class:`LiveConsole` (a terminal): a ``rich`` live panel with step/total,
  ETA, version, reward, staleness, samples/s, the learner's wait fraction,
  buffer fill, turns and tool use when the batch held multi-turn episodes, and
  per-pool replica health from the launcher's own process table (alive,
  restarting, restart count).
- :class:`PlainConsole` (``--quiet``, or stdout is not a terminal): one line per
  learner step, in a fixed format that scripts and tests parse::

      step   12/600  v12    reward 0.063  staleness 1.00/1  samples/s 1949.1  wait 32%

  With multi-turn episodes in the step's batch (``episode_turns_mean`` logged),
  ``  turns 2.1  tools 0.43`` follows ``wait``: turns per episode and the share of
  episodes with a tool call that worked. With ``eval`` on, once a round has reported,
  the line ends with the latest held-out reward and the version it measured:
  ``  eval 0.412 @v10``. Lines logged after training with eval results only
  (``eval_only``: the final policy's round) get no line; the launcher's closing
  message reports it.

Events (a generator restarted, the run stopping) go through ``note`` in both.

Any figure of a record may be missing, null (a NaN the learner logged as null),
not finite, or not a number at all: it shows as ``—`` (or ``nan``/``inf``) and
never raises, since a raise here would end the launcher's supervision.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from asyncrl.config import Config

MISSING = "—"
"""How a figure that is missing, null or not a number is shown."""


def finite(value: object) -> bool:
    """Whether ``value`` is a finite number (None, strings and bools are not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def number(value: object, spec: str = "", add: float = 0, scale: float = 1) -> str:
    """``value * scale + add`` formatted with ``spec``; ``nan``/``inf``/``-inf`` when it
    is not finite, :data:`MISSING` when it is no number (None, a string): never raises."""
    if finite(value):
        return format(value * scale + add, spec)
    if isinstance(value, float):
        return str(value)
    return MISSING


def figure(record: dict, key: str, spec: str = "", add: float = 0, scale: float = 1) -> str:
    """``record[key]`` as :func:`number` shows it (a missing key shows as missing)."""
    return number(record.get(key), spec, add, scale)


@dataclass(frozen=True)
class ReplicaHealth:
    """One generator replica as the launcher sees it."""

    pool: str
    name: str
    state: str
    """``alive``, ``restarting`` (waiting out its back-off) or ``stopped``."""
    restarts: int


class MetricsFollower:
    """New records of ``metrics.jsonl`` since the last call.

    It starts at the file's current end, so a resumed run shows its own steps
    only, and it reads whole lines only (the learner may be mid-write).
    """

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        with self.path.open(errors="replace") as file:  # a bad byte: one bad line
            file.seek(self.offset)
            while (line := file.readline()).endswith("\n"):
                self.offset = file.tell()
                with contextlib.suppress(ValueError):  # a line cut by a crash, or not UTF-8
                    record = json.loads(line)
                    if isinstance(record, dict):
                        records.append(record)
        return records


def step_line(record: dict, total_steps: int, latest_eval: dict | None = None) -> str:
    """The plain view's line for one learner step (its format is an interface: keep it;
    the eval part is only ever appended)."""
    m = record
    line = (
        f"step {figure(m, 'step', add=1):>4}/{total_steps}  v{figure(m, 'version'):<4}  "
        f"reward {figure(m, 'reward_mean', '.3f')}  "
        f"staleness {figure(m, 'staleness_mean', '.2f')}/{figure(m, 'staleness_max', '.0f')}  "
        f"samples/s {figure(m, 'samples_per_s', '.1f')}  "
        f"wait {figure(m, 'learner_wait_frac', '.0%')}"
    )
    if has_episodes(m):
        line += f"  {episode_text(m)}"
    if latest_eval is not None:
        line += f"  eval {eval_text(latest_eval)}"
    return line


def eval_text(record: dict) -> str:
    """``0.412 @v10``: a round's held-out reward and the version it evaluated."""
    version = figure(record, "eval_policy_version", ".0f")
    return f"{figure(record, 'eval_reward_mean', '.3f')} @v{version}"


def episode_text(record: dict) -> str:
    """``turns 2.1  tools 0.43``: a batch's turns per episode, and the share of its
    episodes with at least one tool call that worked."""
    turns = figure(record, "episode_turns_mean", ".1f")
    return f"turns {turns}  tools {figure(record, 'episode_tool_success_frac', '.2f')}"


def has_episodes(record: dict) -> bool:
    """Whether ``record``'s batch held multi-turn episodes (single-turn lines stay as
    they were)."""
    return "episode_turns_mean" in record


def has_eval(record: dict) -> bool:
    """Whether ``record`` (a metrics.jsonl line) reports an eval round."""
    return record.get("eval_reward_mean") is not None


class RunConsole(Protocol):
    def update(self, health: list[ReplicaHealth]) -> None:
        """Show the steps logged since the last call and the replicas' health."""

    def note(self, message: str, error: bool = False) -> None:
        """An event worth a line of its own; ``error`` sends it to stderr."""

    def close(self) -> None: ...


class PlainConsole:
    """One line per learner step; health is only reported through ``note``."""

    def __init__(
        self, metrics: Path, total_steps: int, out: TextIO = sys.stdout, err: TextIO = sys.stderr
    ):
        self.follower = MetricsFollower(metrics)
        self.total_steps = total_steps
        self.out = out
        self.err = err
        self.latest_eval: dict | None = None

    def update(self, health: list[ReplicaHealth]) -> None:
        for record in self.follower.poll():
            if has_eval(record):
                self.latest_eval = record
            if not record.get("eval_only"):
                self.out.write(step_line(record, self.total_steps, self.latest_eval) + "\n")
        self.out.flush()

    def note(self, message: str, error: bool = False) -> None:
        stream = self.err if error else self.out
        stream.write(message + "\n")
        stream.flush()

    def close(self) -> None:
        self.out.flush()


class LiveConsole:
    """A ``rich`` panel redrawn in place; notes scroll above it."""

    def __init__(self, metrics: Path, config: Config, run_dir: Path, steps_done: int = 0):
        self.follower = MetricsFollower(metrics)
        self.config = config
        self.title = f"asyncrl · {config.run.name} · {run_dir}"
        self.held_limit = config.buffer.max_held_samples or 4 * config.algorithm.samples_per_step
        self.last: dict | None = None
        self.latest_eval: dict | None = None
        self.health: list[ReplicaHealth] = []
        self.progress = Progress(
            TextColumn("step"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task(
            "steps", total=config.run.total_steps, completed=steps_done
        )
        self.console = Console()
        self.errors = Console(stderr=True)
        self.live = Live(self.render(), console=self.console, refresh_per_second=4)
        self.live.start()

    def update(self, health: list[ReplicaHealth]) -> None:
        records = self.follower.poll()
        steps = [record for record in records if not record.get("eval_only")]
        if steps:
            self.last = steps[-1]
            step = self.last.get("step")
            if finite(step):
                self.progress.update(self.task, completed=step + 1)
        for record in records:
            if has_eval(record):
                self.latest_eval = record
        self.health = health
        self.live.update(self.render())

    def note(self, message: str, error: bool = False) -> None:
        (self.errors if error else self.console).print(Text(message))

    def close(self) -> None:
        self.live.stop()

    def render(self) -> Group:
        return Group(Text(self.title, style="bold"), self.progress, self.figures(), self.pools())

    def figures(self) -> Table:
        table = Table.grid(padding=(0, 1))
        m = self.last
        if m is None:
            table.add_row(Text("waiting for the first learner step…", style="dim"))
            return table
        held = m.get("buffer_held", 0.0)
        fill = held / self.held_limit if finite(held) else held
        for _ in range(3):
            table.add_column(style="dim")
            table.add_column(style="bold", min_width=12)
        staleness = (
            f"{figure(m, 'staleness_mean', '.2f')} mean, {figure(m, 'staleness_max', '.0f')} max"
        )
        buffer = f"{number(held, '.0f')}/{self.held_limit} samples ({number(fill, '.0%')})"
        table.add_row(
            "version", figure(m, "version"),
            "reward", figure(m, "reward_mean", ".3f"),
            "staleness", staleness,
        )  # fmt: skip
        table.add_row(
            "samples/s", figure(m, "samples_per_s", ".1f"),
            "learner wait", figure(m, "learner_wait_frac", ".0%"),
            "buffer", buffer,
        )  # fmt: skip
        if has_episodes(m):
            table.add_row(
                "turns", figure(m, "episode_turns_mean", ".1f"),
                "tool success", figure(m, "episode_tool_success_frac", ".0%"),
                "tool errors", figure(m, "episode_tool_error_frac", ".0%"),
            )  # fmt: skip
        if self.latest_eval is not None:
            table.add_row("eval reward", eval_text(self.latest_eval))
        return table

    def pools(self) -> Table:
        table = Table("pool", "replicas", "alive", "restarting", "restarts", box=None)
        by_pool: dict[str, list[ReplicaHealth]] = {}
        for replica in self.health:
            by_pool.setdefault(replica.pool, []).append(replica)
        for pool, replicas in by_pool.items():
            alive = sum(r.state == "alive" for r in replicas)
            restarting = sum(r.state == "restarting" for r in replicas)
            table.add_row(
                pool,
                str(len(replicas)),
                Text(str(alive), style="green" if alive == len(replicas) else "yellow"),
                Text(str(restarting), style="yellow" if restarting else ""),
                str(sum(r.restarts for r in replicas)),
            )
        return table


@contextlib.contextmanager
def open_console(
    config: Config, run_dir: Path, quiet: bool, steps_done: int = 0
) -> Iterator[RunConsole]:
    """The live panel on a terminal; plain lines with ``quiet`` or when output is redirected.

    ``steps_done``: where a resumed run starts, so the bar and the ETA start there.
    """
    metrics = run_dir / "metrics.jsonl"
    console: RunConsole
    if quiet or not sys.stdout.isatty():
        console = PlainConsole(metrics, config.run.total_steps)
    else:
        console = LiveConsole(metrics, config, run_dir, steps_done)
    try:
        yield console
    finally:
        console.close()
