"""The command line: overrides anywhere after the config, export-model's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.cli import main


def test_overrides_may_follow_an_option(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny: {}}\n")
    launched = {}

    def fake_launch(config, run_dir, resume=False, quiet=False):
        launched.update(config=config, quiet=quiet)
        return 0

    monkeypatch.setattr("asyncrl.launch.launch", fake_launch)
    argv = ["launch", str(config), "buffer.max_staleness=2", "--quiet", "run.total_steps=7"]
    assert main(argv) == 0
    assert launched["quiet"] is True
    assert launched["config"].run.total_steps == 7
    assert launched["config"].buffer.max_staleness == 2


def test_a_stray_word_is_still_an_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny: {}}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(config), "--bogus"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_export_model_names_a_missing_gguf_file(tmp_path, capsys):
    missing = tmp_path / "nothing.gguf"
    assert main(["export-model", str(missing), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no GGUF file" in err and str(missing) in err
    assert not (tmp_path / "out").exists()


def test_launch_refuses_to_run_model_code_without_its_sandbox(tmp_path, monkeypatch, capsys):
    """A tool environment whose isolation cannot be built stops the launch before any
    process or run directory exists, with one line that says how to install it."""
    from asyncrl.envs import tools
    from asyncrl.envs.sandbox import Sandbox

    unbuildable = Sandbox(bwrap=str(tmp_path / "no-bwrap-here"))
    monkeypatch.setattr(tools, "python_sandbox_for", lambda **_: unbuildable)
    run_dir = tmp_path / "run"
    config = Path(__file__).resolve().parents[2] / "configs" / "tool_calling.yaml"
    assert main(["launch", str(config), "--run-dir", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("asyncrl: ") and error.count("\n") == 1
    assert "apt-get install bubblewrap" in error
    assert "python_isolation: none" in error
    assert not run_dir.exists()
