"""Bad config input fails at load time with one line naming where: YAML files that are not
UTF-8, too big, alias bombs or hold duplicate keys; values that are non-finite, booleans
for numbers, out of any sane range; plug-in files that are not there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    machine_problems,
)

MODEL = "model:\n  tiny: {}\n"


def write(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def only_problem(path: Path | None, overrides: list[str] = ()) -> str:
    """The one problem load_config reports; it must be one line."""
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["model.tiny={}", *overrides] if path is None else list(overrides))
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert "\n" not in problems[0] and "\r" not in problems[0]
    return problems[0]


# --------------------------------------------------------------------------
# the file's bytes


def test_a_utf16_file_is_named_as_utf16_not_a_traceback(tmp_path):
    path = write(tmp_path, MODEL.encode("utf-16"))

    assert only_problem(path) == f"{path}: config file is UTF-16 text; save it as UTF-8"


def test_utf16_without_a_byte_order_mark_names_the_file_line_and_offset(tmp_path):
    path = write(tmp_path, MODEL.encode("utf-16-le"))

    assert only_problem(path).startswith(f"{path}:1: NUL byte at offset 1:")


def test_a_latin1_file_names_the_line_offset_and_byte(tmp_path):
    path = write(tmp_path, (MODEL + "run:\n  name: caf\xe9\n").encode("latin-1"))

    problem = only_problem(path)

    assert problem.startswith(f"{path}:4: not UTF-8 text: byte 0xe9 at offset 34")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path, b"\xef\xbb\xbf" + (MODEL + "run:\n  name: caf\xe9\n").encode())

    assert load_config(path).run.name == "caf\xe9"


def test_a_control_character_names_its_line_on_one_line(tmp_path):
    path = write(tmp_path, MODEL + "run:\n  name: a\x01b\n")

    assert only_problem(path).startswith(f"{path}:4: not valid YAML: character #x0001")


def test_a_file_over_the_size_limit_is_refused_naming_file_and_size(tmp_path):
    path = write(tmp_path, MODEL + "# " + "x" * (10 * 2**20) + "\n")

    problem = only_problem(path)

    assert problem.startswith(f"{path}: config file is 10.0 MiB; at most 256 KiB")


def test_a_file_just_under_the_size_limit_loads(tmp_path):
    padding = MAX_CONFIG_BYTES - len(MODEL) - 3
    path = write(tmp_path, MODEL + "# " + "x" * padding + "\n")

    assert load_config(path).model.tiny is not None


# --------------------------------------------------------------------------
# YAML structure: aliases, nesting, duplicate keys


def billion_laughs(levels: int = 9) -> str:
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, levels):
        aliases = ", ".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{aliases}]")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)  # expanded, it would be 10**9 values: hours and all the memory
def test_an_alias_bomb_is_refused_naming_the_file_and_line(tmp_path):
    path = write(tmp_path, MODEL + billion_laughs())

    problem = only_problem(path)

    assert problem.startswith(f"{path}:")
    assert "expands to more than 100000 values" in problem


def test_aliases_within_the_bound_still_work(tmp_path):
    text = MODEL + "generators:\n  stop: &stops [a, b]\n  pools: [{name: x, stop: *stops}]\n"

    config = load_config(write(tmp_path, text))

    assert config.generators.pools[0].stop == ["a", "b"]


@pytest.mark.parametrize("cycle", ["x: &a [1, *a]\n", "x: &a {k: *a}\n"])
def test_an_alias_inside_the_node_it_names_is_refused(tmp_path, cycle):
    path = write(tmp_path, MODEL + cycle)

    assert only_problem(path) == f"{path}:3: alias *a is inside the node it names"


def test_nesting_beyond_the_limit_is_refused_not_a_recursion_error(tmp_path):
    path = write(tmp_path, MODEL + "x: " + "[" * 5000 + "]" * 5000 + "\n")

    assert only_problem(path) == f"{path}:3: nested more than 64 levels deep"


def test_a_duplicate_key_names_the_key_path_and_both_lines(tmp_path):
    path = write(tmp_path, MODEL + "learner:\n  lr: 0.1\n  sync_interval: 1\n  lr: 0.2\n")

    problem = only_problem(path)

    assert problem == (
        f"{path}:6: duplicate key 'learner.lr' (YAML keeps only one of them); first at line 4"
    )


def test_a_duplicate_section_is_refused(tmp_path):
    path = write(tmp_path, MODEL + "run:\n  seed: 1\nrun:\n  seed: 2\n")

    assert "duplicate key 'run'" in only_problem(path)


def test_a_duplicate_key_inside_a_list_item_names_its_index(tmp_path):
    path = write(tmp_path, MODEL + "generators:\n  pools:\n    - {name: a, name: b}\n")

    assert "duplicate key 'generators.pools.0.name'" in only_problem(path)


def test_a_merge_key_overridden_by_an_explicit_key_is_not_a_duplicate(tmp_path):
    text = MODEL + (
        "generators:\n  pools:\n    - &base {name: a, replicas: 2}\n    - {<<: *base, name: b}\n"
    )

    pools = load_config(write(tmp_path, text)).generators.pools

    assert [(pool.name, pool.replicas) for pool in pools] == [("a", 2), ("b", 2)]


def test_errors_point_at_the_line_of_a_list_item(tmp_path):
    text = MODEL + "generators:\n  pools:\n    - {name: a}\n    - {name: b, replicas: -1}\n"
    path = write(tmp_path, text)

    assert only_problem(path).startswith(f"{path}:6: generators.pools.1.replicas:")


# --------------------------------------------------------------------------
# overrides go through the same checks


def test_an_override_with_a_duplicate_key_is_refused():
    problem = only_problem(None, ["learner={lr: 0.1, lr: 0.2}"])

    assert problem == (
        "override 'learner={lr: 0.1, lr: 0.2}': duplicate key 'lr' (YAML keeps only one of them)"
    )


@pytest.mark.timeout(30)
def test_an_override_alias_bomb_is_refused():
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for level in range(1, 8):
        levels.append(f"&a{level} [{', '.join([f'*a{level - 1}'] * 10)}]")

    problem = only_problem(None, [f"generators.stop=[{', '.join(levels)}]"])

    assert problem.startswith("override 'generators.stop=")
    assert "expands to more than 100000 values" in problem


def test_an_override_value_over_the_size_limit_is_refused():
    problem = only_problem(None, ["run.name=" + "x" * (MAX_CONFIG_BYTES + 1)])

    assert problem.endswith("': the value is over 256 KiB")


def test_an_override_that_is_not_yaml_is_still_taken_as_text():
    config = load_config(None, ["model.tiny={}", "generators.stop=[a, b]", "run.name=a,b]"])

    assert config.run.name == "a,b]"


# --------------------------------------------------------------------------
# numbers: finite, in range, not booleans


@pytest.mark.parametrize(
    "key",
    [
        "learner.lr",
        "learner.grad_clip",
        "reward.timeout_s",
        "reward.min",
        "algorithm.kl_coef",
        "algorithm.clip_c",  # Optional
        "learner.resources.node",  # dict values
        "eval.final_timeout_s",
        "run.stall_timeout_s",
        "buffer.heartbeat_timeout_s",
        "generators.temperature",
    ],
)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_no_float_setting_takes_inf_or_nan(key, value):
    problem = only_problem(None, [f"{key}={value}"])

    assert f": {key}: Input should be a finite number" in problem


@pytest.mark.parametrize(
    "override",
    [
        "generators.pools=[{name: a, top_p: .nan}]",
        "environment={name: tools, python_timeout_s: .inf}",
        "environment={name: tools, step_timeout_s: .nan}",
    ],
)
def test_nested_floats_take_no_inf_or_nan_either(override):
    assert "Input should be a finite number" in only_problem(None, [override])


@pytest.mark.parametrize(
    "override",
    [
        "reward.timeout_s=1e30",
        "reward.timeout_s=86401",
        "environment={name: tools, python_timeout_s: 1e30}",
        "environment={name: tools, step_timeout_s: 1e9}",
        "learner.stop_timeout_s=1e12",
        "eval.final_timeout_s=1e12",
        "buffer.heartbeat_timeout_s=1e12",
    ],
)
def test_timeouts_have_an_upper_bound(override):
    assert "Input should be less than or equal to 86400" in only_problem(None, [override])


def test_a_day_long_timeout_is_still_accepted():
    config = load_config(None, ["model.tiny={}", "reward.timeout_s=86400"])

    assert config.reward.timeout_s == 86400.0


@pytest.mark.parametrize("value", ["0", "-1e-3", "2"])
def test_the_learning_rate_is_positive_and_at_most_1(value):
    assert "learner.lr: Input should be" in only_problem(None, [f"learner.lr={value}"])


def test_a_learning_rate_written_as_1e_minus_3_in_yaml_is_a_number(tmp_path):
    # YAML 1.1 reads `1e-3` (no dot) as a string; it must still be accepted as 0.001
    config = load_config(write(tmp_path, MODEL + "learner:\n  lr: 1e-3\n"))

    assert config.learner.lr == pytest.approx(1e-3)


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(10**30)])
def test_seeds_outside_what_numpy_takes_are_refused(seed):
    assert ": run.seed: Input should be" in only_problem(None, [f"run.seed={seed}"])


def test_the_largest_numpy_seed_is_accepted():
    assert load_config(None, ["model.tiny={}", f"run.seed={2**32 - 1}"]).run.seed == 2**32 - 1


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("buffer.max_staleness=true", "buffer.max_staleness"),
        ("algorithm.group_size=false", "algorithm.group_size"),
        ("run.seed=true", "run.seed"),
        ("generators.pools=[{name: a, replicas: true}]", "generators.pools.0.replicas"),
        ("environment={name: tools, max_turns: true}", "environment.max_turns"),
        ("buffer.max_staleness=2.5", "buffer.max_staleness"),
    ],
)
def test_integer_settings_take_no_booleans_or_fractions(override, key):
    assert f": {key}: Input should be a valid integer" in only_problem(None, [override])


@pytest.mark.parametrize("override", ["learner.lr=true", "reward.timeout_s=false"])
def test_float_settings_take_no_booleans(override):
    assert "expected a number, got" in only_problem(None, [override])


def test_integers_still_pass_for_floats_and_ints_from_yaml_files(tmp_path):
    text = MODEL + "learner:\n  grad_clip: 2\nbuffer:\n  max_staleness: 3\n"

    config = load_config(write(tmp_path, text))

    assert (config.learner.grad_clip, config.buffer.max_staleness) == (2.0, 3)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("generators.max_new_tokens=100000000000000000000", "generators.max_new_tokens"),
        ("generators.pools=[{name: a, max_new_tokens: 10000000}]", "generators.pools.0"),
        ("algorithm.group_size=1000000", "algorithm.group_size"),
        ("run.total_steps=10000000000", "run.total_steps"),
        ("algorithm.prompts_per_step=10000000", "algorithm.prompts_per_step"),
        ("generators.replicas=100000", "generators.replicas"),
        ("reward.workers=100000", "reward.workers"),
        ("learner.world_size=100000", "learner.world_size"),
        ("cluster.buffer_port=65536", "cluster.buffer_port"),
        ("model.tiny={hidden_size: 10000000}", "model.tiny.hidden_size"),
        ("data.max_prompt_tokens=10000000000", "data.max_prompt_tokens"),
        ("environment={name: tools, max_total_tokens: 10000000000}", "environment"),
    ],
)
def test_counts_a_careless_user_could_set_to_crash_a_role_are_bounded(override, key):
    assert f": {key}" in only_problem(None, [override])


def test_a_huge_value_is_shown_shortened_in_the_one_line():
    problem = only_problem(None, ["buffer.max_staleness=" + "x" * 10000])

    assert len(problem) < 300
    assert problem.endswith("...")


def test_a_key_holding_a_newline_still_gives_one_line(tmp_path):
    path = write(tmp_path, MODEL + 'run:\n  "bad\\nkey": 1\n')

    assert "unknown key 'run.bad\\nkey'" in only_problem(path)


# --------------------------------------------------------------------------
# run.name becomes a directory


@pytest.mark.parametrize("name", ["", "  ", "../up", "a/b", "a\\b", "..", "a\x00b", "a\nb"])
def test_a_run_name_that_is_not_one_directory_name_is_refused(tmp_path, name):
    path = write(tmp_path, MODEL + f"run:\n  name: {name!r}\n".replace("'", '"'))

    assert only_problem(path).startswith(f"{path}:4: run.name: ")


@pytest.mark.parametrize("name", ["hello world", "quickstart", "run.2", "café"])
def test_ordinary_run_names_are_accepted(name):
    assert load_config(None, ["model.tiny={}", f"run.name={name}"]).run.name == name


# --------------------------------------------------------------------------
# plug-ins named by file


def test_a_reward_function_file_that_is_not_there_names_key_path_and_line(tmp_path):
    missing = tmp_path / "nowhere" / "reward.py"
    path = write(tmp_path, MODEL + f"reward:\n  function: {missing}:score\n")

    problem = only_problem(path)

    assert problem.startswith(f"{path}:4: reward.function: no such file '{missing}'")


def test_a_reward_function_file_that_is_there_is_accepted(tmp_path):
    reward = write(tmp_path, "def score(*args):\n    return 1.0\n", "reward.py")

    config = load_config(None, ["model.tiny={}", f"reward.function={reward}:score"])

    assert config.reward.function == f"{reward}:score"


def test_a_relative_reward_file_is_looked_up_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    problem = only_problem(None, ["reward.function=my.py:score"])
    write(tmp_path, "def score(*args):\n    return 1.0\n", "my.py")

    assert problem.startswith("override 'reward.function=my.py:score': reward.function: ")
    assert f"relative paths are read from {tmp_path}" in problem
    assert load_config(None, ["model.tiny={}", "reward.function=my.py:score"])


def test_a_module_reward_function_is_not_checked_at_load_time():
    config = load_config(None, ["model.tiny={}", "reward.function=some_package.rewards:score"])

    assert config.reward.function == "some_package.rewards:score"


def test_a_reward_function_without_a_colon_is_refused():
    problem = only_problem(None, ["reward.function=score"])

    assert problem.endswith("expected module:function or path/to/file.py:function, got 'score'")


def test_an_environment_file_that_is_not_there_is_refused(tmp_path):
    missing = tmp_path / "env.py"

    problem = only_problem(None, [f"environment={{name: '{missing}:Env'}}"])

    assert f"environment.name: no such file '{missing}'" in problem


def test_a_saved_config_naming_a_missing_file_still_loads_elsewhere():
    """`asyncrl status` and the roles read a run's saved config from other directories."""
    raw = {"model": {"tiny": {}}, "reward": {"function": "relative/reward.py:score"}}

    assert config_from_dict(raw).reward.function == "relative/reward.py:score"


# --------------------------------------------------------------------------
# fields other roles read


def test_new_fields_have_their_defaults():
    config = load_config(None, ["model.tiny={}"])

    assert config.run.stall_timeout_s == 900.0
    assert config.learner.keep_checkpoints is None
    assert config.reward.memory_limit_mb == 4096
    assert config.buffer.stale_retries == 2


@pytest.mark.parametrize(
    "override",
    [
        "run.stall_timeout_s=5",
        "run.stall_timeout_s=-1",
        f"run.stall_timeout_s={7 * 86400 + 1}",
        "learner.keep_checkpoints=0",
        "reward.memory_limit_mb=63",
        "reward.memory_limit_mb=1048577",
        "buffer.stale_retries=-1",
        "buffer.stale_retries=101",
    ],
)
def test_new_fields_are_bounded(override):
    key = override.partition("=")[0]

    assert only_problem(None, [override]).startswith(f"override '{override}': {key}: ")


@pytest.mark.parametrize(
    "override",
    [
        "run.stall_timeout_s=0",
        "run.stall_timeout_s=10",
        "learner.keep_checkpoints=1",
        "reward.memory_limit_mb=64",
        "buffer.stale_retries=0",
        "buffer.stale_retries=100",
    ],
)
def test_new_fields_accept_their_bounds(override):
    assert isinstance(load_config(None, ["model.tiny={}", override]), Config)


# --------------------------------------------------------------------------
# the machine: not schema errors, asked by the launcher


def config_with(*overrides: str) -> Config:
    return load_config(None, ["model.tiny={}", *overrides])


def test_a_config_that_fits_the_machine_has_no_problems():
    assert machine_problems(config_with(), cuda_devices=0, cpus=2) == []


def test_more_cpu_ranks_than_4x_the_cores_is_a_machine_problem():
    config = config_with("learner.world_size=9")

    assert machine_problems(config, cuda_devices=0, cpus=2) == [
        "learner.world_size=9 is more than 4x the 2 CPUs of this machine: the ranks would "
        "spend their time waiting for a core"
    ]
    assert machine_problems(config, cuda_devices=0, cpus=4) == []


def test_more_ranks_than_gpus_is_a_machine_problem_on_cuda():
    problems = machine_problems(config_with("learner.world_size=4"), cuda_devices=2, cpus=64)

    assert problems == [
        "learner.world_size=4 is more than the 2 CUDA device(s) of this machine: each rank "
        "needs a GPU of its own"
    ]


def test_device_cuda_without_a_gpu_is_a_machine_problem():
    problems = machine_problems(config_with("learner.device=cuda"), cuda_devices=0, cpus=8)

    assert problems == ["learner.device=cuda, but this machine has no CUDA device"]


def test_generators_asking_for_more_gpus_than_exist_is_a_machine_problem():
    config = config_with(
        "generators.num_gpus=1", "generators.pools=[{name: a, replicas: 3}, {name: b}]"
    )

    problems = machine_problems(config, cuda_devices=2, cpus=8)

    assert problems == [
        "generator replicas ask for 4 GPU(s) (replicas x generators.num_gpus), but this "
        "machine has 2 CUDA device(s)"
    ]


def test_a_joined_ray_cluster_may_span_machines_so_nothing_is_checked():
    config = config_with("cluster.backend=ray", "cluster.address=auto", "learner.world_size=64")

    assert machine_problems(config, cuda_devices=0, cpus=1) == []


def test_without_a_gpu_driver_the_launcher_counts_no_device_and_imports_no_torch(tmp_path):
    """The count the launcher asks for at every start: with no GPU driver on the machine it
    is 0 without importing torch (a second and more of a launch on a small CPU)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from asyncrl.core import machine\n"
        f"machine.GPU_DRIVER_PATHS = ({str(tmp_path / 'no-driver')!r},)\n"
        "print(machine._cuda_device_count(), 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["0", "False"], result.stderr


def test_machine_problems_is_not_a_schema_error():
    config = config_with("learner.world_size=512")

    assert config.learner.world_size == 512  # valid here, for a bigger machine
    assert machine_problems(config, cuda_devices=0, cpus=os.cpu_count() or 1)
