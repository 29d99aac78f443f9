"""Entry point of each process the launcher starts: ``python -m asyncrl.run.roles ROLE RUN_DIR``.

Every role runs with the config the launcher validated and holds in memory,
handed over as JSON in the environment variable ``ASYNCRL_CONFIG``
(:func:`config_env`), so all processes of a run agree on one configuration,
ports included. A generator the launcher restarts gets that same config again:
``RUN_DIR/config.yaml`` is a record for people and ``asyncrl status``, never
read back by a process the launcher starts, so whoever can write that file
cannot change what a restarted role runs (a ``reward.function`` of theirs, say).
Only a role started by hand, without the variable, reads ``RUN_DIR/config.yaml``.

Each role reports what it is doing in ``RUN_DIR/progress/NAME.json`` from its
start (:mod:`asyncrl.core.progress`), for the launcher's watchdog.

A role started by the launcher reads its credentials, its role's alone, from
the pipe the launcher handed it (:func:`asyncrl.core.credentials.receive_handed`)
before anything else can; a role started by hand reads what the keys folder
holds for it, which is never the learner's.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

import yaml

from asyncrl.config import Config, config_from_dict
from asyncrl.core import progress
from asyncrl.core.cores import pin_this_process
from asyncrl.core.credentials import receive_handed
from asyncrl.core.paths import replica_name

ROLES = ("buffer", "learner", "generator")
CONFIG_ENV = "ASYNCRL_CONFIG"
"""The launcher's validated config, as JSON, for the role it starts."""
CONFIG_ENV_MAX_BYTES = 120 * 1024
"""Linux refuses to start a process with one environment string over 128 KiB."""

log = logging.getLogger("asyncrl.roles")


def config_env(config: Config) -> dict[str, str]:
    """The environment that hands ``config`` to a role (:func:`read_config`)."""
    text = json.dumps(config.model_dump(mode="json"), separators=(",", ":"))
    if len(text.encode()) > CONFIG_ENV_MAX_BYTES:
        raise ValueError(
            f"the resolved config is {len(text.encode())} bytes as JSON; a role can be handed "
            f"at most {CONFIG_ENV_MAX_BYTES} through {CONFIG_ENV}"
        )
    return {CONFIG_ENV: text}


def read_config(run_dir: Path) -> Config:
    """The config this role runs with: the launcher's (``ASYNCRL_CONFIG``), validated
    as any config is; ``RUN_DIR/config.yaml`` only for a role started by hand.

    The variable is removed from this process's environment once read, so the
    role's own child processes (reward workers, engines) do not inherit it.
    """
    text = os.environ.pop(CONFIG_ENV, None)
    if text is not None:
        return config_from_dict(json.loads(text))
    path = run_dir / "config.yaml"
    log.info("no %s from a launcher: reading %s", CONFIG_ENV, path)
    return config_from_dict(yaml.safe_load(path.read_text()))


def main(argv: list[str] | None = None) -> str:
    """Run the role named in ``argv`` to its end; returns the role."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.run.roles")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--index", type=int, default=0, help="replica index (generators)")
    parser.add_argument("--pool", default="default", help="generator pool (generators)")
    parser.add_argument(
        "--restarts", type=int, default=0, help="times this replica was restarted (generators)"
    )
    parser.add_argument(
        "--resume-from", type=Path, help="checkpoint directory to continue from (buffer, learner)"
    )
    args = parser.parse_args(argv)
    receive_handed()  # read and closed at once: no child of the role inherits the pipe
    pin_this_process()  # on the cores the launcher gave it, before torch starts a thread
    name = args.role
    if args.role == "generator":
        name = replica_name(args.pool, args.index)
    if args.role == "learner" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        name = f"learner-{os.environ['RANK']}"
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    progress.start(args.run_dir, name, args.role)  # "starting" until its main loop runs
    config = read_config(args.run_dir)
    if args.role == "buffer":
        from asyncrl.buffer.main import run

        run(config, args.run_dir, args.resume_from)
    elif args.role == "learner":
        from asyncrl.learner.trainer import run

        run(config, args.run_dir, args.resume_from)
    else:
        from asyncrl.generators.main import run

        run(config, args.run_dir, args.index, pool=args.pool, restarts=args.restarts)
    return args.role


def end_without_finalizing() -> NoReturn:
    """End a role process whose work is done and closed: run the exit handlers (logging's
    flush, temporary folders' removal, multiprocessing's joins), then leave without
    finalizing the interpreter.

    Finalizing an interpreter that imported torch and transformers frees every module's
    objects one by one: 0.93 s against 0.04 s on a 2-core CPU, paid by every role at every
    stop, one phase after another (generators, then the buffer).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if main() == "learner":
        # Not under Ray (whose actors call main()): a learner process that has
        # saved and closed everything ends here, before gloo's threads can abort
        # the interpreter's finalization (see exit_without_finalizing).
        from asyncrl.learner.distributed import exit_without_finalizing

        exit_without_finalizing()
    end_without_finalizing()
