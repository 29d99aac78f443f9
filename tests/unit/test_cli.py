"""The command line: overrides anywhere after the config, export-model's errors."""

from __future__ import annotations

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
