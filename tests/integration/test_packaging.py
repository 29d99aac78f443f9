"""The wheel holds every mapped subpackage, so it installs as well as editable mode does."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-q", "-w", out, REPO], check=True, capture_output=True)
    (path,) = out.glob("asyncrl-*.whl")
    return path


def source_modules(folder: str, package: str) -> set[str]:
    root = REPO / folder
    return {f"{package}/{p.relative_to(root)}" for p in root.rglob("*.py")}


def test_wheel_maps_the_deployment_folders_onto_asyncrl_subpackages(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("learner", "generators", "buffer"):
        assert source_modules(folder, f"asyncrl/{folder}") <= names
    assert source_modules("asyncrl", "asyncrl") <= names
    assert not any(name.startswith(("learner/", "buffer/", "generators/")) for name in names)
    assert any(name.endswith("entry_points.txt") for name in names)


def test_installed_wheel_imports_every_role_without_the_source_tree(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel],
        check=True, capture_output=True,
    )  # fmt: skip
    code = (
        "import asyncrl, asyncrl.buffer.service, asyncrl.learner.trainer, "
        "asyncrl.generators.worker; print(asyncrl.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))
