"""The ``asyncrl`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from asyncrl.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="run buffer, learner and generators on this machine"
    )
    launch.add_argument("config", type=Path, help="YAML config, e.g. configs/quickstart.yaml")
    launch.add_argument("overrides", nargs="*", help="key.path=value, e.g. buffer.max_staleness=2")
    launch.add_argument("--run-dir", type=Path, help="directory for this run (default: a new one)")

    validate = commands.add_parser("validate", help="check a config and print it resolved")
    validate.add_argument("config", type=Path)
    validate.add_argument("overrides", nargs="*")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print(f"asyncrl: invalid config ({len(error.problems)} problem(s)):", file=sys.stderr)
        for problem in error.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    from asyncrl.launch import launch

    return launch(config, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
