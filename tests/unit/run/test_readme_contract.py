"""The README contract: two commands, and CI runs the second one verbatim.

A fresh machine needs only the README's two commands (set up and run the
quickstart; set up and run the tests), and `.ci/run` must run the test command
as written there, so an edit to one cannot silently drift from the other.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from asyncrl.config import load_config

REPO = Path(__file__).resolve().parents[3]


def readme_commands() -> list[str]:
    """The bash blocks of the README's "Two commands" section, in order."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^## Two commands\n(.*?)^## ", readme, re.S | re.M)
    assert match, "README.md has no '## Two commands' section"
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", match.group(1), re.S)]


def test_the_readme_gives_exactly_two_one_line_commands():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in command for command in commands), commands


def test_the_quickstart_command_sets_up_then_launches_the_shipped_quickstart():
    quickstart = readme_commands()[0]
    setup, launch = (part.strip() for part in quickstart.split("&&"))
    assert shlex.split(setup)[:2] == ["bash", "scripts/setup.sh"]
    words = shlex.split(launch)
    assert words[:2] == [".venv/bin/asyncrl", "launch"], words
    config = REPO / words[2]
    assert config.is_file(), f"the README launches {words[2]}, which does not exist"
    load_config(config)  # valid as shipped: the launch cannot stop at its config


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = readme_commands()[1]
    assert "pytest" in test_command and "scripts/setup.sh" in test_command
    ci_lines = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines, f".ci/run does not run the README's {test_command!r}"
    ci_script = (REPO / ".ci/run").read_text()
    assert "set -euo pipefail" in ci_script  # a failing test fails CI


@pytest.mark.parametrize("script", ["scripts/setup.sh", ".ci/run"])
def test_scripts_the_commands_run_are_executable_bash(script):
    path = REPO / script
    assert path.read_text().startswith("#!/usr/bin/env bash\n"), script
    assert os.access(path, os.X_OK), f"{script} is not executable"
