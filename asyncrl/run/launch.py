"""``asyncrl launch``: check the run, prepare its directory, and hand it to a backend.

It validates the config (before anything starts: CURVE keys, isolation, data,
reward function, machine), creates the run directory, and runs the roles
either as local processes (:mod:`asyncrl.run.local_run`, with the ports it picked
written into ``RUN_DIR/config.yaml``) or as Ray actors (``cluster.backend:
ray``, :mod:`asyncrl.run.ray.cluster`). Both backends follow one supervision policy
(:mod:`asyncrl.run.supervision`: generators restarted after a back-off, a failed or
stalled learner or buffer stops the run, the stop in dependency order) and end
alike (:mod:`asyncrl.run.closing`: done, or why not and how to resume). A run
directory that cannot be written is refused in a line (status 2) before
anything starts.
"""

from __future__ import annotations

import sys
import tempfile
from datetime import datetime
from pathlib import Path

from asyncrl.config import Config, save_config
from asyncrl.core.cores import launcher_plan
from asyncrl.core.paths import latest_checkpoint
from asyncrl.core.progress import PROGRESS_DIR
from asyncrl.core.security import provision_run, resolve_keys
from asyncrl.core.transport import free_port
from asyncrl.run.closing import closing_message
from asyncrl.run.local_run import Supervisor, launch_local
from asyncrl.run.supervision import stop_phases, stop_timeout_s

__all__ = [
    "Supervisor",
    "closing_message",
    "launch",
    "make_run_dir",
    "resolve_ports",
    "stop_phases",
    "stop_timeout_s",
    "unwritable",
]


def make_run_dir(config: Config, run_dir: Path | None) -> Path:
    """Create the run directory; OSError naming the directory if it cannot be written."""
    if run_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(config.run.output_dir) / f"{config.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for directory in (run_dir, run_dir / "logs", run_dir / PROGRESS_DIR):
        directory.mkdir(exist_ok=True)
        _check_writable(directory)
    return run_dir


def _check_writable(directory: Path) -> None:
    """Create and remove a file in ``directory``: an existing directory may still refuse
    the logs and checkpoints (read-only, another user's), and should do so now."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise OSError(error.errno, error.strerror, str(directory)) from None


def unwritable(error: OSError) -> int:
    """Say in one line which path of the run directory cannot be written; status 2."""
    where = f" {error.filename}" if error.filename else ""
    print(
        f"asyncrl: cannot write the run directory{where}: {error.strerror or error} "
        "(choose another with --run-dir or run.output_dir)",
        file=sys.stderr,
        flush=True,
    )
    return 2


def resolve_ports(config: Config) -> Config:
    cluster = config.cluster
    updates = {
        "buffer_port": cluster.buffer_port or free_port(cluster.bind_address),
        "weights_port": cluster.weights_port or free_port(cluster.bind_address),
    }
    config = config.model_copy(update={"cluster": cluster.model_copy(update=updates)})
    weights = config.weights
    if weights.transport == "collective" and not weights.group_port:
        group_port = free_port(cluster.bind_address)
        config = config.model_copy(
            update={"weights": weights.model_copy(update={"group_port": group_port})}
        )
    return config


def launch(
    config: Config, run_dir: Path | None = None, resume: bool = False, quiet: bool = False
) -> int:
    """Run to completion; returns the exit status for the command line.

    With ``resume``, ``run_dir`` is an earlier run: it continues from its newest
    complete checkpoint, with fresh ports. ``quiet`` prints one line per step
    instead of the live panel.
    """
    resume_from = None
    if resume:
        resume_from = latest_checkpoint(run_dir)
        if resume_from is None:
            print(f"asyncrl: {run_dir} has no complete checkpoint to resume from", file=sys.stderr)
            return 2
    config = resolve_keys(config, run_dir)  # CURVE keys missing: refused before anything starts
    if config.environment is not None:  # model code would run unisolated: refused likewise
        from asyncrl.generation.envs.sandbox import check_isolation_for

        check_isolation_for(config)
    from asyncrl.run.preflight import preflight

    preflight(config)  # data, reward function, environment, machine: PreflightError
    try:  # an unwritable run directory is said in a line, before anything starts
        run_dir = make_run_dir(config, run_dir)
        # each role's credentials, the learner's new and kept in memory (docs/security.md)
        config, credentials = provision_run(config, run_dir)
    except OSError as error:
        return unwritable(error)
    if config.cluster.backend == "ray":  # the roles as Ray actors (docs/ray.md)
        from asyncrl.run.ray.cluster import launch_ray

        return launch_ray(config, run_dir, resume_from, quiet, credentials)
    config = resolve_ports(config)
    cores = launcher_plan(config)
    try:
        save_config(config, run_dir / "config.yaml")
        cores.save(run_dir)
    except OSError as error:
        return unwritable(error)
    return launch_local(config, run_dir, resume_from, quiet, credentials, cores)
