"""The command line: overrides anywhere after the config, export-model's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.run.cli import main


def test_overrides_may_follow_an_option(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny: {}}\n")
    launched = {}

    def fake_launch(config, run_dir, resume=False, quiet=False):
        launched.update(config=config, quiet=quiet)
        return 0

    monkeypatch.setattr("asyncrl.run.launch.launch", fake_launch)
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
    from asyncrl.generation.envs.sandbox import checks as sandbox_checks
    from asyncrl.generation.envs.sandbox import runner as sandbox_runner

    monkeypatch.setattr(sandbox_runner, "bwrap_path", lambda name: None)  # not installed
    monkeypatch.setattr(sandbox_checks, "_CHECKED", set())  # forget earlier tests' probes
    run_dir = tmp_path / "run"
    config = Path(__file__).resolve().parents[3] / "configs" / "tool_calling.yaml"
    assert main(["launch", str(config), "--run-dir", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("asyncrl: ") and error.count("\n") == 1
    assert "apt-get install bubblewrap" in error
    assert "python_isolation: none" in error
    assert not run_dir.exists()


# --------------------------------------------------------------------------
# preflight: data, reward function and environment checked before anything starts


def raising_reward(tmp_path: Path) -> str:
    (tmp_path / "my_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return extra_info['answer']\n"
    )
    return f"reward.function={tmp_path / 'my_reward.py'}:compute_score"


def tiny_config(tmp_path: Path) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text("model: {tiny: {}}\n")
    return config


def test_validate_prints_the_config_only_when_the_preflight_passes(tmp_path, capsys):
    config = tiny_config(tmp_path)
    assert main(["validate", str(config), raising_reward(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "asyncrl: the run cannot start (1 problem(s)):",
        f"  reward.function: task.digits prompt 0: {tmp_path / 'my_reward.py'}:compute_score "
        "raised on this row (given its ground truth as the response): KeyError: 'answer'",
    ]
    assert main(["validate", str(config)]) == 0
    assert "model:" in capsys.readouterr().out


def test_validate_no_data_skips_reading_the_prompt_files(tmp_path, capsys):
    config = tiny_config(tmp_path)
    missing = f"data.train_files=[{tmp_path / 'missing.jsonl'}]"
    assert main(["validate", str(config), missing]) == 2
    assert f"  data.train_files: {tmp_path / 'missing.jsonl'}: no such data file\n" in (
        capsys.readouterr().err
    )
    assert main(["validate", str(config), missing, "--no-data"]) == 0
    assert "train_files:" in capsys.readouterr().out


def test_launch_refuses_a_bad_data_file_before_any_process_or_run_directory(
    tmp_path, monkeypatch, capsys
):
    def no_run_dir(*args):
        raise AssertionError("the launch went on to create its run directory")

    monkeypatch.setattr("asyncrl.run.launch.make_run_dir", no_run_dir)
    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"prompt": [{"role": "user", "content": "caf\xe9"}]}\n')
    run_dir = tmp_path / "run"
    argv = ["launch", str(tiny_config(tmp_path)), f"data.train_files=[{data}]"]
    assert main([*argv, "--run-dir", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "asyncrl: the run cannot start (1 problem(s)):"
    assert err[1] == (
        f"  data.train_files: {data}:1: not UTF-8 text (byte 0xe9 at byte 45 of the line); "
        "save the file as UTF-8"
    )
    assert not run_dir.exists()


def test_launch_refuses_a_reward_function_that_raises_on_the_built_in_task(
    tmp_path, monkeypatch, capsys
):
    """The issue: generators failed at start-up and restarted for ever."""
    monkeypatch.setattr("asyncrl.run.launch.make_run_dir", lambda *args: pytest.fail("started"))
    argv = ["launch", str(tiny_config(tmp_path)), raising_reward(tmp_path), "--quiet"]
    assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    assert "KeyError: 'answer'" in capsys.readouterr().err


def test_a_joining_generator_checks_its_reward_function_first(tmp_path, monkeypatch, capsys):
    joined = []
    monkeypatch.setattr("asyncrl.generators.main.join", lambda *args: joined.append(args))
    argv = ["generator", "--config", str(tiny_config(tmp_path)), "--buffer", "tcp://127.0.0.1:1"]
    assert main([*argv, raising_reward(tmp_path)]) == 2
    assert "KeyError: 'answer'" in capsys.readouterr().err
    assert joined == []
    assert main(argv) == 0
    assert len(joined) == 1


def test_what_the_machine_lacks_warns_in_validate_and_refuses_a_launch(
    tmp_path, monkeypatch, capsys
):
    """A config may be meant for a bigger machine: validate says so, launch stops."""
    lacks = ["learner.device=cuda, but this machine has no CUDA device"]
    monkeypatch.setattr("asyncrl.run.preflight.machine_problems", lambda config: lacks)
    monkeypatch.setattr("asyncrl.run.launch.make_run_dir", lambda *args: pytest.fail("started"))
    config = str(tiny_config(tmp_path))
    assert main(["validate", config]) == 0
    out, err = capsys.readouterr()
    assert "model:" in out
    assert err == f"asyncrl: warning: on this machine: {lacks[0]}\n"
    assert main(["launch", config, "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "asyncrl: the run cannot start (1 problem(s)):",
        f"  {lacks[0]}",
    ]
