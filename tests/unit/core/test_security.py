"""Endpoint security settings: when CURVE is required, the `asyncrl keys` command,
launch refusing a reachable endpoint without keys before anything starts, and what a
run's keys folder holds (tests/unit/core/test_credentials.py: who is given what)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.core.keys_folder import GROUP_KEY
from asyncrl.core.security import (
    KEY_FILES,
    SecurityError,
    client_context,
    curve_keys,
    generate_keys,
    provision_run,
    resolve_keys,
)
from asyncrl.run import cli

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def cluster(*overrides: str):
    return load_config(QUICKSTART, list(overrides)).cluster


def test_endpoints_bind_to_loopback_without_curve_by_default():
    default = cluster()
    assert (default.bind_address, default.uses_curve) == ("127.0.0.1", False)
    assert curve_keys(default) is None
    assert not cluster("cluster.host=localhost").uses_curve


@pytest.mark.parametrize(
    "override",
    ["cluster.bind=0.0.0.0", "cluster.bind=*", "cluster.bind=node-3", "cluster.host=10.1.2.3"],
)
def test_any_other_interface_requires_curve(override):
    assert cluster(override).uses_curve


def test_curve_can_be_required_on_loopback_too():
    assert cluster("cluster.curve=true").uses_curve


def test_curve_cannot_be_turned_off_for_a_reachable_interface():
    with pytest.raises(ConfigError) as error:
        cluster("cluster.bind=0.0.0.0", "cluster.curve=false")
    assert "cluster.curve=false with cluster.bind=0.0.0.0" in str(error.value)
    assert "asyncrl keys RUN_DIR" in str(error.value)


def test_a_role_without_a_keys_dir_is_told_to_name_one():
    with pytest.raises(SecurityError, match=r"cluster\.keys_dir is empty"):
        curve_keys(cluster("cluster.curve=true"))


def test_launch_check_names_the_missing_keys_and_the_command(tmp_path):
    config = load_config(QUICKSTART, ["cluster.bind=0.0.0.0"])
    with pytest.raises(SecurityError) as error:
        resolve_keys(config, tmp_path / "run")
    message = str(error.value)
    assert "cluster.bind=0.0.0.0 is not a loopback interface" in message
    assert f"asyncrl keys {tmp_path / 'run'}" in message
    assert "server.key_secret" in message


def test_launch_check_without_a_run_dir_asks_for_one():
    config = load_config(QUICKSTART, ["cluster.bind=0.0.0.0"])
    with pytest.raises(SecurityError, match="--run-dir RUN_DIR"):
        resolve_keys(config, None)


def test_launch_check_of_a_custom_keys_dir_names_the_config_key(tmp_path):
    config = load_config(QUICKSTART, ["cluster.curve=true", f"cluster.keys_dir={tmp_path}/mine"])
    with pytest.raises(SecurityError, match=r"cluster\.keys_dir=.*point cluster\.keys_dir at"):
        resolve_keys(config, None)


def test_launch_check_saves_an_absolute_keys_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    generate_keys(Path("run"))
    config = load_config(QUICKSTART, ["cluster.bind=0.0.0.0"])
    resolved = resolve_keys(config, Path("run"))
    assert resolved.cluster.keys_dir == str(tmp_path / "run" / "keys")
    unchanged = load_config(QUICKSTART)
    assert resolve_keys(unchanged, Path("run")) is unchanged


def test_launch_refuses_a_reachable_endpoint_without_keys_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["launch", str(QUICKSTART), "cluster.bind=0.0.0.0", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 2
    assert f"run `asyncrl keys {run_dir}` first" in capsys.readouterr().err
    assert not run_dir.exists()  # no run directory, so no process either


def test_keys_command_writes_private_secrets_and_refuses_to_overwrite(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["keys", str(run_dir)]) == 0
    keys = run_dir / "keys"
    # no learner keypair: the learner gets a new one at every launch, and no file
    assert sorted(path.name for path in keys.iterdir()) == sorted([*KEY_FILES, GROUP_KEY])
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
    first = {name: (keys / name).read_text() for name in KEY_FILES}

    assert cli.main(["keys", str(run_dir)]) == 1
    assert "pass --force to replace them" in capsys.readouterr().err
    assert {name: (keys / name).read_text() for name in KEY_FILES} == first

    assert cli.main(["keys", str(run_dir), "--force"]) == 0
    replaced = {name: (keys / name).read_text() for name in KEY_FILES}
    assert all(replaced[name] != first[name] for name in KEY_FILES)


# ---------------------------------------------------------------- loopback runs


def test_authentication_is_on_by_default_and_cannot_be_dropped_beyond_loopback():
    assert cluster().auth
    with pytest.raises(ConfigError, match=r"cluster\.auth=false with cluster\.bind=0\.0\.0\.0"):
        cluster("cluster.bind=0.0.0.0", "cluster.auth=false")
    with pytest.raises(ConfigError, match=r"cluster\.curve=true"):
        cluster("cluster.curve=true", "cluster.auth=false")


def test_a_loopback_run_keeps_on_disk_only_what_a_process_started_by_hand_needs(tmp_path):
    config = load_config(QUICKSTART)
    resolved, credentials = provision_run(config, tmp_path / "run")
    keys = tmp_path / "run" / "keys"
    assert resolved.cluster.keys_dir == str(keys)
    assert sorted(path.name for path in keys.iterdir()) == [
        "generator.secret",
        GROUP_KEY,
        "observer.secret",
    ]
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("generator.secret", "observer.secret"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600
        assert (keys / name).read_text().strip() == credentials.passwords[name.split(".")[0]]
    on_disk = b"".join(path.read_bytes() for path in keys.iterdir())
    assert credentials.passwords["learner"].encode() not in on_disk
    assert credentials.group_seeds["learner"].encode() not in on_disk


def test_a_resume_keeps_the_generators_credentials_and_makes_the_learner_s_anew(tmp_path):
    config = load_config(QUICKSTART)
    resolved, first = provision_run(config, tmp_path / "run")
    (tmp_path / "run" / "keys" / "run.secret").write_text("0" * 64)  # an older asyncrl's
    _, resumed = provision_run(resolved, tmp_path / "run")
    for role in ("generator", "observer"):  # a generator that joined by hand goes on
        assert resumed.passwords[role] == first.passwords[role]
    assert resumed.passwords["learner"] != first.passwords["learner"]
    assert resumed.group_publics["learner"] != first.group_publics["learner"]
    group_key = (tmp_path / "run" / "keys" / GROUP_KEY).read_text().strip()
    assert group_key == resumed.group_publics["learner"]
    assert not (tmp_path / "run" / "keys" / "run.secret").exists()
    _, other = provision_run(config, tmp_path / "other")
    assert other.passwords["generator"] != first.passwords["generator"]


def test_a_run_with_authentication_off_gets_no_credentials(tmp_path, caplog):
    config = load_config(QUICKSTART, ["cluster.auth=false"])
    assert provision_run(config, tmp_path / "run") == (config, None)
    assert not (tmp_path / "run").exists()
    assert "any process on this machine may speak" in caplog.text


def test_a_role_without_its_credentials_is_told_how_to_get_them(tmp_path):
    config = load_config(QUICKSTART, [f"cluster.keys_dir={tmp_path}"])
    with pytest.raises(SecurityError, match=r"generator\.secret are missing: start the run with"):
        client_context(config.cluster, "generator")
    (tmp_path / "generator.secret").write_text("short\n")
    with pytest.raises(SecurityError, match="holds no password"):
        client_context(config.cluster, "generator")
    with pytest.raises(SecurityError, match="handed to the learner process alone"):
        client_context(config.cluster, "learner")
    with pytest.raises(ValueError, match="unknown role 'admin'"):
        client_context(config.cluster, "admin")


@pytest.mark.parametrize("address", ["auto", "10.0.0.5:6379", "head-node:6379"])
def test_joining_a_ray_cluster_requires_curve_from_the_start(address):
    # the endpoints are advertised on the buffer's node address only once it is placed:
    # credentials made for loopback before that left the learner with none it could use
    joined = cluster("cluster.backend=ray", f"cluster.address={address}")
    assert joined.bind_address == "127.0.0.1"  # not advertised yet
    assert joined.joins_cluster and joined.uses_curve


@pytest.mark.parametrize(
    "overrides",
    [
        ["cluster.backend=ray"],
        ["cluster.backend=ray", "cluster.address=127.0.0.1:6379"],
        ["cluster.backend=local", "cluster.address=auto"],
    ],
)
def test_a_local_ray_or_a_loopback_head_keeps_loopback_credentials(overrides):
    assert not cluster(*overrides).uses_curve


def test_joining_a_cluster_without_keys_is_refused_before_anything_starts(tmp_path):
    config = load_config(QUICKSTART, ["cluster.backend=ray", "cluster.address=auto"])
    with pytest.raises(SecurityError) as error:
        resolve_keys(config, tmp_path / "run")
    assert "cluster.address=auto joins a Ray cluster" in str(error.value)
    assert f"asyncrl keys {tmp_path / 'run'}" in str(error.value)


def test_curve_cannot_be_turned_off_when_joining_a_cluster():
    with pytest.raises(ConfigError, match=r"cluster\.curve=false with cluster\.address=auto"):
        cluster("cluster.backend=ray", "cluster.address=auto", "cluster.curve=false")
