"""Entry point of each process the launcher starts: ``python -m asyncrl.roles ROLE RUN_DIR``.

Every role reads the resolved ``RUN_DIR/config.yaml`` that the launcher wrote,
so all processes of a run agree on one configuration, ports included.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import yaml

from asyncrl.config import config_from_dict
from asyncrl.paths import replica_name

ROLES = ("buffer", "learner", "generator")


def main(argv: list[str] | None = None) -> str:
    """Run the role named in ``argv`` to its end; returns the role."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.roles")
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
    name = args.role
    if args.role == "generator":
        name = replica_name(args.pool, args.index)
    if args.role == "learner" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        name = f"learner-{os.environ['RANK']}"
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    config = config_from_dict(yaml.safe_load((args.run_dir / "config.yaml").read_text()))
    if args.role == "buffer":
        from asyncrl.buffer.service import run

        run(config, args.run_dir, args.resume_from)
    elif args.role == "learner":
        from asyncrl.learner.trainer import run

        run(config, args.run_dir, args.resume_from)
    else:
        from asyncrl.generators.worker import run

        run(config, args.run_dir, args.index, pool=args.pool, restarts=args.restarts)
    return args.role


if __name__ == "__main__":
    if main() == "learner":
        # Not under Ray (whose actors call main()): a learner process that has
        # saved and closed everything ends here, before gloo's threads can abort
        # the interpreter's finalization (see exit_without_finalizing).
        from asyncrl.learner.distributed import exit_without_finalizing

        exit_without_finalizing()
