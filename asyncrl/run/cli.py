"""The ``asyncrl`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from asyncrl.config import ConfigError, config_warnings, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    launch = commands.add_parser(
        "launch", help="run buffer, learner and generators on this machine"
    )
    launch.add_argument(
        "config",
        type=Path,
        nargs="?",
        help="YAML config, e.g. configs/quickstart.yaml (default with --resume: the run's own)",
    )
    launch.add_argument("overrides", nargs="*", help="key.path=value, e.g. buffer.max_staleness=2")
    launch.add_argument("--run-dir", type=Path, help="directory for this run (default: a new one)")
    launch.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue RUN_DIR from its newest complete checkpoint",
    )
    launch.add_argument(
        "--quiet",
        action="store_true",
        help="one plain line per step instead of the live panel (also when output is not a TTY)",
    )

    validate = commands.add_parser(
        "validate",
        help="check a config, its data, reward function and environment; print it resolved",
    )
    validate.add_argument("config", type=Path)
    validate.add_argument("overrides", nargs="*")
    validate.add_argument(
        "--no-data",
        action="store_true",
        help="do not read the prompt files nor load the tokenizer (e.g. for another machine)",
    )

    generator = commands.add_parser(
        "generator", help="start a generator replica that joins a live run"
    )
    generator.add_argument("--config", type=Path, required=True, help="the run's config")
    generator.add_argument(
        "--buffer", required=True, metavar="tcp://HOST:PORT", help="the run's buffer endpoint"
    )
    generator.add_argument("--pool", default="default", help="the pool whose settings it uses")
    generator.add_argument(
        "--work-dir", type=Path, default=Path("asyncrl-generators"), help="engine scratch files"
    )
    generator.add_argument("overrides", nargs="*", help="key.path=value")

    status = commands.add_parser("status", help="roles, versions, buffer and recent metrics")
    status.add_argument("run_dir", type=Path, metavar="RUN_DIR")

    keys = commands.add_parser(
        "keys", help="create the CURVE keys a run needs to listen beyond 127.0.0.1"
    )
    keys.add_argument("dir", type=Path, metavar="RUN_DIR", help="the keys go into RUN_DIR/keys")
    keys.add_argument(
        "--force", action="store_true", help="replace existing keys (old holders are refused)"
    )

    export = commands.add_parser(
        "export-model",
        help="write a model (Hugging Face folder, Hub name or .gguf file) as a Hugging Face folder",
    )
    export.add_argument("source", help="model.name_or_path: a folder, a Hub name or a .gguf file")
    export.add_argument("output", type=Path, help="the folder to write")
    export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return parser


def _export_model(source: str, output: Path, dtype: str) -> int:
    from asyncrl.generation.models import export_pretrained

    try:
        export_pretrained(source, output, dtype)
    except (OSError, ValueError) as error:
        print(f"asyncrl: cannot export {source}: {error}", file=sys.stderr)
        return 2
    print(f"model written to {output} (use model.name_or_path={output})")
    return 0


def _keys(directory: Path, force: bool) -> int:
    from asyncrl.core.security import generate_keys

    try:
        keys = generate_keys(directory, force=force)
    except (FileExistsError, OSError) as error:
        print(f"asyncrl: {error}", file=sys.stderr)
        return 1
    print(f"CURVE keys written to {keys}/ (secret files readable by you only)")
    print(f"  launch with: asyncrl launch CONFIG --run-dir {directory} cluster.bind=0.0.0.0")
    print(
        "  generator machines need server.key, client.key and client.key_secret (and group.key "
        "with weights.transport=collective); never server.key_secret (docs/security.md)"
    )
    return 0


def _problems(title: str, problems: list[str]) -> int:
    """Print ``problems`` under ``title``, one line each, as every refusal does; 2."""
    print(f"asyncrl: {title} ({len(problems)} problem(s)):", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    return 2


def _preflight(config, *, data: bool = True, machine: bool = True) -> int:
    """0 when :func:`asyncrl.run.preflight.preflight` finds nothing; else its problems, 2."""
    from asyncrl.run.preflight import PreflightError, preflight

    try:
        notes = preflight(config, data=data, machine=machine)
    except PreflightError as error:
        return _problems("the run cannot start", error.problems)
    for note in notes:
        print(f"asyncrl: {note}", file=sys.stderr)
    return 0


def _generator(config, buffer: str, pool: str, work_dir: Path) -> int:
    import logging

    from asyncrl.generators.main import join

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s generator %(levelname)s %(name)s: %(message)s"
    )
    pools = [p.name for p in config.generators.resolved_pools()]
    if pool not in pools:
        print(f"asyncrl: --pool {pool!r} is not in the config; its pools: {pools}", file=sys.stderr)
        return 2
    if config.environment is not None:  # model code would run unisolated: refused
        from asyncrl.generation.envs.sandbox import SandboxUnavailable, check_isolation_for

        try:
            check_isolation_for(config)
        except SandboxUnavailable as error:
            print(f"asyncrl: {error}", file=sys.stderr)
            return 2
    # its reward function and environment: joining would fail at start-up, and restart
    if status := _preflight(config, data=False, machine=False):
        return status
    join(config, buffer, pool, work_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # `launch CONFIG --quiet key=value`: overrides may follow an option too
    args, extra = parser.parse_known_args(argv)
    strays = [item for item in extra if "=" not in item or item.startswith("-")]
    if strays or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(strays or extra)}")
    if extra:
        args.overrides += extra
    if args.command == "keys":
        return _keys(args.dir, args.force)
    if args.command == "export-model":
        return _export_model(args.source, args.output, args.dtype)
    if args.command == "status":
        from asyncrl.run.status import show

        return show(args.run_dir)
    resume = getattr(args, "resume", None)
    if args.command == "launch":
        if resume is not None and args.run_dir is not None:
            parser.error("--resume RUN_DIR continues in RUN_DIR; do not also give --run-dir")
        if args.config is None and resume is None:
            parser.error("launch needs a CONFIG (or --resume RUN_DIR)")
        if args.config is not None and "=" in args.config.name and resume is not None:
            args.overrides.insert(0, str(args.config))  # `--resume RUN key=value`: no config
            args.config = None
        if args.config is None:
            args.config = resume / "config.yaml"
    dropped: list[str] | None = (
        [] if resume is not None and args.config == resume / "config.yaml" else None
    )
    try:
        config = load_config(args.config, args.overrides, dropped=dropped)
    except ConfigError as error:
        return _problems("invalid config", error.problems)
    for knob in dropped or []:
        print(
            f"asyncrl: warning: {args.config}: {knob} ignored (saved by an earlier asyncrl)",
            file=sys.stderr,
        )
    for warning in config_warnings(config):
        print(f"asyncrl: warning: {warning}", file=sys.stderr)
    if args.command == "validate":  # what this machine lacks: a warning, not a refusal
        if status := _preflight(config, data=not args.no_data, machine=False):
            return status
        from asyncrl.run.preflight import machine_checks

        for problem in machine_checks(config):
            print(f"asyncrl: warning: on this machine: {problem}", file=sys.stderr)
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    if args.command == "generator":
        return _generator(config, args.buffer, args.pool, args.work_dir)
    from asyncrl.core.security import SecurityError
    from asyncrl.generation.envs.sandbox import SandboxUnavailable
    from asyncrl.run.launch import launch
    from asyncrl.run.preflight import PreflightError

    try:
        if resume is not None:
            return launch(config, resume, resume=True, quiet=args.quiet)
        return launch(config, args.run_dir, quiet=args.quiet)
    except PreflightError as error:  # launch() checks data, rewards, environment first
        return _problems("the run cannot start", error.problems)
    except (SecurityError, SandboxUnavailable) as error:
        print(f"asyncrl: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
