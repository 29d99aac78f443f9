"""``cluster.backend: ray``: the run's roles as Ray actors, placed by the resources they ask for.

The driver (``asyncrl launch`` on a machine of the cluster) joins the Ray
cluster at ``cluster.address``, or starts a local Ray on 127.0.0.1 for this run
and shuts it down at the end. Then:

1. the actors are placed (:mod:`asyncrl.run.ray.plan` says what each asks for,
   :mod:`asyncrl.run.ray.placement` places them): the learner ranks in a placement
   group whose bundle 0 also holds the buffer, one actor per role;
2. the endpoints are advertised on the buffer's node, the resolved config is
   written to ``RUN_DIR/config.yaml`` for people and handed to every role
   from the driver's memory, with its role's credentials;
3. the roles start; the driver prints progress from ``metrics.jsonl`` and
   supervises them by the local launcher's policy (:mod:`asyncrl.run.ray.run`,
   :mod:`asyncrl.run.supervision`) until the learner is done; at the end (or on
   Ctrl-C) every role gets SIGTERM, then every actor is killed.

RUN_DIR must be one shared filesystem path on every node (config, logs,
metrics, checkpoints); see docs/ray.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import psutil

from asyncrl.config import Config
from asyncrl.core.credentials import Credentials
from asyncrl.core.stop_signals import StopSignals
from asyncrl.generation.process_tree import end_survivors
from asyncrl.run.closing import see_through
from asyncrl.run.ray.placement import RayLaunchError
from asyncrl.run.ray.plan import check_resources, local_num_cpus, local_resources
from asyncrl.run.ray.run import RayRun

OBJECT_STORE_BYTES = 200 * 1024**2
"""A local Ray's object store: the roles move their data over ZeroMQ, not through Ray."""
LOCAL_RAY_GRACE_S = 10.0
"""How long a local Ray's processes (its actors' workers above all) get to exit after
``ray.shutdown()`` before the driver kills them: a worker notices its raylet is gone
only at its next poll, late on a busy machine."""
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
"""Set (unless already set) before importing ray: a local Ray then lives on 127.0.0.1
rather than on this machine's network address (Ray's own switch for single-machine
instances), with the token authentication Ray enables by default, minus its warning."""


def launch_ray(
    config: Config,
    run_dir: Path,
    resume_from: Path | None = None,
    quiet: bool = False,
    credentials: Credentials | None = None,
) -> int:
    """Run to completion on Ray, each actor handed its share of ``credentials``; returns
    the exit status for the command line."""
    from asyncrl.run.console import open_console

    problems = check_resources(config)
    if problems:
        print(f"asyncrl: cannot run on Ray ({len(problems)} problem(s)):", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    run_dir = run_dir.resolve()
    before = {child.pid for child in psutil.Process().children()}
    try:
        ray = _connect(config)
    except RayLaunchError as error:
        print(f"asyncrl: {error}", file=sys.stderr, flush=True)
        return 1
    try:
        with open_console(config, run_dir, quiet) as console:
            console.note(f"run dir: {run_dir}")
            if resume_from is not None:
                console.note(f"resuming from {resume_from}")
            # the first signal is recorded for the driver's loops to act on: an exception
            # raised by the handler inside a Ray call would surface as a SystemError
            with StopSignals() as requests:
                run = RayRun(ray, config, run_dir, resume_from, requests, credentials)
                return see_through(
                    console,
                    requests,
                    run_dir,
                    start=lambda: run.start(console),
                    supervise=lambda: run.supervise(console),
                    stop=run.stop,
                    health=run.health,
                    stopping="every actor",
                    ended="stopped",
                )
    finally:
        # a local Ray is this run's own: the driver's children since ray.init (GCS, raylet)
        # and theirs (the actors' workers), listed before the shutdown, ended if they outlive it
        ours = _started_since(before) if config.cluster.address is None else []
        ray.shutdown()
        if killed := end_survivors(ours, LOCAL_RAY_GRACE_S):
            print(
                f"asyncrl: ray: {killed} process(es) of the local Ray outlived its shutdown "
                f"by {LOCAL_RAY_GRACE_S:g} s; killed them",
                file=sys.stderr,
                flush=True,
            )


def _started_since(before: set[int]) -> list[psutil.Process]:
    """The driver's children not in ``before`` and every process below them."""
    found = []
    for child in psutil.Process().children():
        if child.pid not in before:
            found.append(child)
            with contextlib.suppress(psutil.NoSuchProcess):
                found += child.children(recursive=True)
    return found


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
