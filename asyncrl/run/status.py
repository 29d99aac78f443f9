"""``asyncrl status RUN_DIR``: what a live or finished run is doing, from outside it.

Reads what the run directory holds (resolved config, metrics, checkpoints,
logs) and, if the run is live, asks its buffer (a :class:`StatusRequest`, one
second at most) for the policy version, what it holds and the generators it
hears from. Nothing here can disturb the run: the buffer answers a status
request like a heartbeat, from its own loop.

A figure that is missing, null, not finite or not a number shows as ``—`` (or
``nan``/``inf``), and a line of ``metrics.jsonl`` that is not a JSON object is
skipped: a status never ends in a traceback.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
import zmq
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from asyncrl.config import Config, ConfigError, config_from_dict
from asyncrl.core.cores import CorePlan
from asyncrl.core.messages import Status, StatusRequest
from asyncrl.core.paths import latest_checkpoint
from asyncrl.core.security import OBSERVER, client_context
from asyncrl.core.transport import RequestClient, tcp
from asyncrl.run.console import figure

RECENT_STEPS = 5
ASK_TIMEOUT_S = 1.0


def ask_buffer(config: Config, timeout_s: float = ASK_TIMEOUT_S) -> Status | None:
    """The live buffer's :class:`Status`, or None if nothing answers in ``timeout_s``."""
    if not config.cluster.buffer_port:
        return None
    context = client_context(config.cluster, OBSERVER)
    client = RequestClient(context, tcp(config.cluster.host, config.cluster.buffer_port))
    try:
        reply, _ = client.request(StatusRequest(), timeout_s=timeout_s)
        return reply if isinstance(reply, Status) else None
    except (TimeoutError, zmq.ZMQError):
        return None
    finally:
        client.close()
        context.destroy(linger=0)


def read_metrics(run_dir: Path) -> list[dict]:
    """One record per learner step: the lines logged after training with eval results
    only (``eval_only``, such as the final policy's) are left out."""
    return [record for record in read_records(run_dir) if not record.get("eval_only")]


def read_records(run_dir: Path) -> list[dict]:
    """Every complete line of ``metrics.jsonl``, the ``eval_only`` ones included."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    complete = text[: text.rfind("\n") + 1]  # a live learner may be writing the last line
    return [record for line in complete.splitlines() if isinstance(record := _record(line), dict)]


def _record(line: str) -> object:
    """A line's JSON value; None for a line that is blank or not JSON (cut by a crash)."""
    try:
        return json.loads(line) if line.strip() else None
    except ValueError:
        return None


def show(run_dir: Path, console: Console | None = None) -> int:
    """Print the status of the run in ``run_dir``; 0 if it is a run directory, else 2."""
    console = console or Console()
    config_path = run_dir / "config.yaml"
    if not config_path.exists():
        console.print(f"[red]asyncrl: {run_dir} is not a run directory (no config.yaml)[/red]")
        return 2
    try:
        config = config_from_dict(yaml.safe_load(config_path.read_text()))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError) as error:
        reason = " ".join(str(error).split())
        console.print(f"[red]asyncrl: {escape(str(config_path))}: {escape(reason)}[/red]")
        return 2
    records = read_records(run_dir)
    metrics = [record for record in records if not record.get("eval_only")]
    live = ask_buffer(config)
    finished = (run_dir / "final").exists()

    state = "live" if live else ("finished" if finished else "not running")
    last = metrics[-1] if metrics else {}
    console.print(f"[bold]{escape(config.run.name)}[/bold]  {run_dir}  " + escape(f"[{state}]"))
    model = config.model.name_or_path or "tiny model built from config"
    console.print(
        f"model {model}; step {len(metrics)}/{config.run.total_steps}, "
        f"version {figure(last, 'version') if last else 0}"
    )
    checkpoint = latest_checkpoint(run_dir)
    console.print(f"latest complete checkpoint: {checkpoint or 'none'}")

    console.print(roles_table(run_dir))
    if (plan := CorePlan.load(run_dir)) is not None:
        console.print(escape(plan.summary()))

    pools = Table("pool", "replicas", "backend", title="generator pools (config)")
    for pool in config.generators.resolved_pools():
        pools.add_row(pool.name, str(pool.replicas), pool.settings.backend)
    console.print(pools)

    if live is not None:
        print_live(console, config, live)

    evaluated = [record for record in records if record.get("eval_reward_mean") is not None]
    if evaluated:
        console.print(eval_line(evaluated[-1]))

    if metrics:
        console.print(recent_steps(metrics[-RECENT_STEPS:]))
    return 0


def roles_table(run_dir: Path) -> Table:
    """Each role's log and how long ago it was last written."""
    roles = Table("role", "log", "last written", title="roles")
    for log in sorted((run_dir / "logs").glob("*.log")):
        age = time.time() - log.stat().st_mtime
        roles.add_row(log.stem, str(log), f"{age:.0f}s ago")
    return roles


def print_live(console: Console, config: Config, live: Status) -> None:
    """What the running buffer says: its holdings, and each generator it hears from."""
    stats = live.stats
    console.print(
        f"buffer at {tcp(config.cluster.host, config.cluster.buffer_port)}: policy version "
        f"{live.policy_version}, holds {figure(stats, 'buffer_held', '.0f')} samples "
        f"({figure(stats, 'buffer_held_bytes', '.1f', scale=2**-20)} MiB), "
        f"{figure(stats, 'buffer_in_flight_groups', '.0f')} groups in flight, "
        f"{figure(stats, 'buffer_generators_alive', '.0f')} generators alive"
    )
    generators = Table(
        "generator", "pool", "last heard", "samples sent", "weight swaps", title="generators"
    )
    for name, counters in sorted(live.generators.items()):
        generators.add_row(
            name,
            live.pools.get(name, "default"),
            f"{figure(counters, 'seen_s_ago', '.1f')}s ago",
            figure(counters, "samples_sent", ".0f"),
            figure(counters, "weight_swaps", ".0f"),
        )
    console.print(generators)


def recent_steps(records: list[dict]) -> Table:
    """The last steps' version, reward, staleness and throughput."""
    recent = Table(
        "step", "version", "reward", "staleness mean/max", "samples/s", title="recent steps"
    )
    for record in records:
        staleness = "/".join(
            [figure(record, "staleness_mean", ".2f"), figure(record, "staleness_max", ".0f")]
        )
        recent.add_row(
            figure(record, "step", add=1),
            figure(record, "version"),
            figure(record, "reward_mean", ".3f"),
            staleness,
            figure(record, "samples_per_s", ".1f"),
        )
    return recent


def eval_line(e: dict) -> str:
    """The latest eval round's line: which round, of which version, its reward."""
    kind = "final eval (the final policy)" if e.get("eval_final") else "latest eval"
    when = "after training" if e.get("eval_only") else f"at step {figure(e, 'step', add=1)}"
    return (
        f"{kind}: round {figure(e, 'eval_round', '.0f')} of version "
        f"{figure(e, 'eval_policy_version', '.0f')}, "
        f"reward {figure(e, 'eval_reward_mean', '.3f')} "
        f"over {figure(e, 'eval_samples', '.0f')} held-out samples (logged {when})"
    )
