"""The run configuration: YAML + overrides -> a validated Config, or every problem at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.config import Config, ConfigError, config_from_dict, load_config, save_config
from asyncrl.run.cli import main

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def problems_of(path, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, list(overrides))
    return caught.value.problems


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------
# loading


def test_quickstart_yaml_loads_with_the_values_it_sets():
    config = load_config(QUICKSTART)

    assert isinstance(config, Config)
    assert config.run.name == "quickstart"
    assert config.run.total_steps == 600
    assert config.model.name_or_path is None
    assert config.model.tiny is not None
    assert config.model.tiny.hidden_size == 64
    assert config.algorithm.group_size == 8
    assert config.algorithm.prompts_per_step == 32
    assert config.algorithm.samples_per_step == 256
    assert config.generators.max_active_samples == 128


def test_keys_the_quickstart_leaves_out_take_their_defaults():
    config = load_config(QUICKSTART)

    assert config.algorithm.advantage == "grpo"
    assert config.algorithm.clip_low == 0.2
    assert config.learner.weight_decay == 0.0
    assert config.model.dtype == "float32"
    assert config.model.tiny.max_position_embeddings == 128
    assert config.cluster.host == "127.0.0.1"
    assert config.cluster.buffer_port == 0


def test_a_config_naming_only_the_model_gets_every_other_section_defaulted(tmp_path):
    config = load_config(write(tmp_path, "model:\n  tiny: {}\n"))

    assert config.model.tiny.hidden_size == 64
    assert config.run.total_steps == 100
    assert config.buffer.max_staleness == 1
    assert config.buffer.admission_control is True
    assert config.learner.sync_interval == 1
    assert config.generators.replicas == 2
    assert config.tracking.aim is True


def test_config_can_be_built_from_overrides_alone_without_a_file():
    config = load_config(None, ["model.tiny.hidden_size=32"])

    assert config.model.tiny.hidden_size == 32
    assert config.model.tiny.num_layers == 2


# --------------------------------------------------------------------------
# overrides


def test_override_replaces_the_value_from_the_yaml_file():
    config = load_config(QUICKSTART, ["buffer.max_staleness=3"])

    assert config.buffer.max_staleness == 3
    assert config.run.name == "quickstart"


def test_override_values_are_parsed_as_yaml_scalars():
    config = load_config(
        QUICKSTART,
        [
            "buffer.admission_control=false",
            "learner.lr=0.05",
            "run.name=hello world",
            "model.dtype=bfloat16",
        ],
    )

    assert config.buffer.admission_control is False
    assert config.learner.lr == pytest.approx(0.05)
    assert config.run.name == "hello world"
    assert config.model.dtype == "bfloat16"


def test_a_later_override_of_the_same_key_wins():
    config = load_config(QUICKSTART, ["buffer.max_staleness=2", "buffer.max_staleness=4"])

    assert config.buffer.max_staleness == 4


def test_override_can_set_a_whole_section_with_a_yaml_flow_mapping():
    config = load_config(None, ["model.tiny={hidden_size: 16, num_layers: 1}"])

    assert config.model.tiny.hidden_size == 16
    assert config.model.tiny.num_layers == 1


@pytest.mark.parametrize("override", ["buffer.max_staleness", "=3", "buffer..max_staleness=2"])
def test_malformed_override_is_an_error_naming_the_override(override):
    problems = problems_of(QUICKSTART, [override])

    assert len(problems) == 1
    assert f"override '{override}'" in problems[0]
    assert "expected key.path=value" in problems[0]


# --------------------------------------------------------------------------
# error messages


def test_wrong_type_from_an_override_names_override_key_path_and_value():
    problems = problems_of(QUICKSTART, ["buffer.max_staleness=abc"])

    assert len(problems) == 1
    assert problems[0].startswith("override 'buffer.max_staleness=abc': buffer.max_staleness:")
    assert "valid integer" in problems[0]
    assert "'abc'" in problems[0]


def test_wrong_type_in_a_yaml_file_names_file_and_line_of_the_key(tmp_path):
    path = write(
        tmp_path,
        "# a comment\nmodel:\n  tiny: {}\n\nbuffer:\n  admission_control: true\n"
        "  max_staleness: lots\n",
    )

    problems = problems_of(path)

    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:7: buffer.max_staleness:")
    assert "'lots'" in problems[0]


def test_out_of_range_value_names_the_bound_and_the_value():
    problems = problems_of(QUICKSTART, ["generators.top_p=2"])

    assert problems == [
        "override 'generators.top_p=2': generators.top_p: "
        "Input should be less than or equal to 1, got 2"
    ]


def test_missing_model_section_is_reported(tmp_path):
    problems = problems_of(write(tmp_path, "buffer:\n  max_staleness: 2\n"))

    assert problems == ["config: missing required key 'model'"]


def test_an_empty_yaml_file_reports_the_missing_model_section(tmp_path):
    assert problems_of(write(tmp_path, "")) == ["config: missing required key 'model'"]


def test_unknown_key_in_yaml_names_its_line_and_the_closest_valid_key(tmp_path):
    path = write(tmp_path, "model:\n  tiny: {}\nbuffer:\n  max_stalenes: 2\n")

    problems = problems_of(path)

    assert problems == [
        f"{path}:4: unknown key 'buffer.max_stalenes'; did you mean 'buffer.max_staleness'?"
    ]


def test_unknown_key_in_an_override_names_the_closest_valid_key():
    problems = problems_of(QUICKSTART, ["buffer.max_stalenes=3"])

    assert problems == [
        "override 'buffer.max_stalenes=3': unknown key 'buffer.max_stalenes'; "
        "did you mean 'buffer.max_staleness'?"
    ]


def test_a_leaf_key_given_without_its_section_suggests_the_full_key_path():
    problems = problems_of(QUICKSTART, ["max_staleness=2"])

    assert len(problems) == 1
    assert "did you mean 'buffer.max_staleness'?" in problems[0]


def test_unknown_key_with_no_close_match_lists_the_valid_keys_of_its_section():
    problems = problems_of(QUICKSTART, ["buffer.zzz=1"])

    assert len(problems) == 1
    assert "unknown key 'buffer.zzz'" in problems[0]
    assert "valid keys here: max_staleness, admission_control" in problems[0]


def test_several_errors_are_reported_at_once_one_line_each(tmp_path):
    path = write(
        tmp_path,
        "model:\n  tiny: {}\nrun:\n  total_steps: 0\nbuffer:\n  max_stalenes: 2\n",
    )

    problems = problems_of(path, ["learner.lr=-1", "generators.temperature=hot"])

    assert len(problems) == 4
    assert all("\n" not in problem for problem in problems)
    joined = "\n".join(problems)
    assert f"{path}:4: run.total_steps:" in joined
    assert f"{path}:6: unknown key 'buffer.max_stalenes'" in joined
    assert "override 'learner.lr=-1': learner.lr:" in joined
    assert "override 'generators.temperature=hot': generators.temperature:" in joined


def test_config_error_message_is_the_problems_one_per_line():
    with pytest.raises(ConfigError) as caught:
        load_config(QUICKSTART, ["run.total_steps=0", "learner.lr=0"])

    assert str(caught.value) == "\n".join(caught.value.problems)
    assert len(caught.value.problems) == 2


def test_malformed_overrides_are_all_reported_together():
    problems = problems_of(QUICKSTART, ["a.b", "buffer.max_staleness=2", "=1"])

    assert len(problems) == 2
    assert "override 'a.b'" in problems[0]
    assert "override '=1'" in problems[1]


def test_invalid_yaml_syntax_reports_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  tiny: {}\nbuffer:\n\tmax_staleness: 2\n")

    problems = problems_of(path)

    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:4: not valid YAML:")


def test_a_top_level_list_is_rejected_as_not_a_mapping(tmp_path):
    path = write(tmp_path, "- model\n- buffer\n")

    assert problems_of(path) == [f"{path}: expected a mapping of sections at the top level"]


def test_an_unreadable_config_file_is_reported_not_raised_as_oserror(tmp_path):
    path = tmp_path / "absent.yaml"

    problems = problems_of(path)

    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: cannot read config")


def test_unknown_section_from_an_override_names_the_override_as_its_origin():
    problems = problems_of(QUICKSTART, ["bufer.max_staleness=2"])

    assert problems == [
        "override 'bufer.max_staleness=2': unknown key 'bufer'; did you mean 'buffer'?"
    ]


def test_error_inside_an_override_that_replaces_a_section_names_the_override():
    problems = problems_of(QUICKSTART, ["buffer={max_staleness: many}"])

    assert len(problems) == 1
    assert problems[0].startswith("override 'buffer={max_staleness: many}': buffer.max_staleness")


# --------------------------------------------------------------------------
# cross-field rules


def test_sync_interval_beyond_max_staleness_plus_one_is_rejected_naming_both_keys():
    problems = problems_of(QUICKSTART, ["buffer.max_staleness=1", "learner.sync_interval=3"])

    assert len(problems) == 1
    assert "learner.sync_interval=3" in problems[0]
    assert "buffer.max_staleness + 1 = 2" in problems[0]


def test_sync_interval_equal_to_max_staleness_plus_one_is_allowed():
    config = load_config(QUICKSTART, ["buffer.max_staleness=2", "learner.sync_interval=3"])

    assert config.learner.sync_interval == 3


@pytest.mark.parametrize(
    "model",
    [{}, {"name_or_path": "gpt2", "tiny": {}}],
    ids=["neither", "both"],
)
def test_model_needs_exactly_one_of_name_or_path_and_tiny(model):
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"model": model})

    assert caught.value.problems == [
        "config: model: set exactly one of model.name_or_path or model.tiny"
    ]


def test_model_given_by_name_only_is_valid():
    config = config_from_dict({"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}})

    assert config.model.name_or_path == "Qwen/Qwen2.5-0.5B"
    assert config.model.tiny is None


def test_overriding_the_quickstart_with_a_model_name_too_is_rejected():
    problems = problems_of(QUICKSTART, ["model.name_or_path=gpt2"])

    assert len(problems) == 1
    assert "set exactly one of model.name_or_path or model.tiny" in problems[0]


# --------------------------------------------------------------------------
# the CLI and saving


def test_validate_returns_2_and_prints_the_problem_to_stderr_on_a_bad_config(capsys):
    code = main(["validate", str(QUICKSTART), "buffer.max_stalenes=3"])

    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert "invalid config (1 problem(s))" in captured.err
    assert "did you mean 'buffer.max_staleness'?" in captured.err


def test_validate_returns_0_and_prints_the_resolved_config_as_yaml(capsys):
    code = main(["validate", str(QUICKSTART), "buffer.max_staleness=3"])

    captured = capsys.readouterr()
    assert code == 0
    assert captured.err == ""
    printed = yaml.safe_load(captured.out)
    assert printed["buffer"]["max_staleness"] == 3
    assert config_from_dict(printed) == load_config(QUICKSTART, ["buffer.max_staleness=3"])


def test_saved_config_loads_back_equal(tmp_path):
    config = load_config(QUICKSTART, ["buffer.max_staleness=2", "learner.lr=0.01"])
    path = tmp_path / "saved.yaml"

    save_config(config, path)

    assert config_from_dict(yaml.safe_load(path.read_text())) == config
    assert load_config(path) == config


def test_validate_warns_on_uncorrected_off_policy_training(capsys):
    code = main(["validate", str(QUICKSTART), "algorithm.correction=none"])
    assert code == 0
    err = capsys.readouterr().err
    assert "warning: algorithm.correction=none with buffer.max_staleness=1" in err
    main(["validate", str(QUICKSTART), "algorithm.correction=none", "buffer.max_staleness=0"])
    assert "warning" not in capsys.readouterr().err


def test_learner_minibatches_cannot_exceed_the_batch():
    with pytest.raises(ConfigError, match=r"learner\.minibatches=300 is more than the 256"):
        load_config(QUICKSTART, ["learner.minibatches=300"])


def test_resume_without_a_checkpoint_fails_clearly(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(QUICKSTART.read_text())
    assert main(["launch", "--resume", str(tmp_path)]) == 2
    assert "has no complete checkpoint to resume from" in capsys.readouterr().err


def test_generator_pools_inherit_unset_settings_and_override_the_rest():
    config = load_config(
        None,
        [
            "model.tiny.hidden_size=64",
            "generators.max_new_tokens=16",
            "generators.pools=[{name: fast, replicas: 3, backend: vllm, chunk_tokens: 8},"
            " {name: slow, replicas: 1}]",
        ],
    )
    fast, slow = config.generators.resolved_pools()
    assert (fast.name, fast.replicas, slow.name, slow.replicas) == ("fast", 3, "slow", 1)
    assert (fast.settings.backend, fast.settings.chunk_tokens) == ("vllm", 8)
    assert (slow.settings.backend, slow.settings.chunk_tokens) == ("hf", 4)
    assert fast.settings.max_new_tokens == slow.settings.max_new_tokens == 16
    [default] = load_config(None, ["model.tiny.hidden_size=64"]).generators.resolved_pools()
    assert (default.name, default.replicas) == ("default", 2)


def test_pool_errors_name_the_key():
    with pytest.raises(ConfigError, match="duplicate pool name"):
        load_config(
            None,
            ["model.tiny.hidden_size=64", "generators.pools=[{name: a}, {name: a}]"],
        )
    # the temperature is the run's: a pool cannot set it
    with pytest.raises(ConfigError, match=r"generators\.pools\.0\.temperature"):
        load_config(
            None,
            ["model.tiny.hidden_size=64", "generators.pools=[{name: a, temperature: 0.7}]"],
        )


def test_a_run_saved_with_every_estimators_knobs_still_resumes_with_a_warning(
    tmp_path, monkeypatch, capsys
):
    """Before the algorithm section was split per estimator, a saved config.yaml held
    ``lam``, ``gamma`` and ``value_*`` under grpo (ignored then): resuming such a run
    drops them by name instead of refusing the run's own config."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(QUICKSTART), run_dir / "config.yaml")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    saved["algorithm"] |= {"lam": 0.95, "gamma": 1.0, "value_coef": 0.5}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))

    with pytest.raises(ConfigError, match=r"algorithm\.lam: only used by advantage: gae"):
        load_config(run_dir / "config.yaml")  # a config a person wrote: refused
    dropped: list[str] = []
    config = load_config(run_dir / "config.yaml", dropped=dropped)
    assert config.algorithm.advantage == "grpo"
    assert sorted(dropped) == [
        "algorithm.gamma (only used by advantage: reinforce_pp, gae)",
        "algorithm.lam (only used by advantage: gae)",
        "algorithm.value_coef (only used by advantage: gae)",
    ]

    launched = []
    monkeypatch.setattr(
        "asyncrl.run.launch.launch", lambda config, *a, **k: launched.append(config) or 0
    )
    assert main(["launch", "--resume", str(run_dir)]) == 0
    assert launched and launched[0].algorithm.advantage == "grpo"
    err = capsys.readouterr().err
    assert (
        "algorithm.lam (only used by advantage: gae) ignored (saved by an earlier asyncrl)" in err
    )
