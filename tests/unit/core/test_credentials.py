"""A key per role: each process is given its own role's credentials and nothing that would
let it pose as another, and what a generator can read on disk is never the learner's.

The attack over real sockets on a launched run is tests/integration/test_role_credentials.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq

from asyncrl.config import ClusterConfig
from asyncrl.core.credentials import (
    CREDENTIALS_FD_ENV,
    Credentials,
    SecurityError,
    handed_over,
    held,
    receive_handed,
    verifier,
)
from asyncrl.core.keys_folder import GROUP_KEY, generate_keys, provision
from asyncrl.core.signing import derive_seed, public_key
from asyncrl.weights.collective.groups import group_key


@pytest.fixture(params=["plain", "curve"])
def cluster(request, tmp_path) -> ClusterConfig:
    if request.param == "plain":
        return ClusterConfig(keys_dir=str(tmp_path / "keys"))
    generate_keys(tmp_path)
    return ClusterConfig(keys_dir=str(tmp_path / "keys"), curve=True)


def secrets_of(credentials: Credentials, role: str) -> set[str]:
    """Everything secret ``credentials`` hold that belongs to ``role``."""
    found = {credentials.passwords.get(role), credentials.group_seeds.get(role)}
    pair = credentials.curve_pairs.get(role)
    found.add(pair[1] if pair else None)
    return found - {None}


def test_each_process_gets_its_own_role_s_secrets_and_no_other_s(cluster):
    run = provision(cluster)
    given = {role: run.for_role(role) for role in ("buffer", "learner", "generator", "observer")}
    learner_secrets = secrets_of(run, "learner")
    assert len(learner_secrets) == 2  # a password or keypair, and a signing key
    for role in ("buffer", "generator", "observer"):
        assert not secrets_of(given[role], "learner"), role
        assert not any(secret in given[role].to_json() for secret in learner_secrets), role
    assert secrets_of(given["learner"], "learner") == learner_secrets
    assert not secrets_of(given["learner"], "generator")
    assert set(given["generator"].group_seeds) == {"generator"}
    assert not given["generator"].verifiers and not given["generator"].curve_roles
    assert not given["buffer"].passwords and not given["buffer"].curve_pairs
    assert not given["buffer"].group_seeds and not given["observer"].group_seeds


def test_the_servers_hold_verifiers_not_passwords(tmp_path):
    run = provision(ClusterConfig(keys_dir=str(tmp_path / "keys")))
    buffer = run.for_role("buffer")
    assert set(buffer.verifiers) == {"learner", "generator", "observer"}
    for role, password in run.passwords.items():
        assert buffer.verifiers[role] == verifier(password) != password
        assert password not in buffer.to_json()


def readable_secrets(path: Path) -> list[bytes]:
    """What a reader of ``path`` could use as a secret: its text, or a certificate's key."""
    text = path.read_bytes().strip()
    if path.name.endswith(".key_secret"):
        return [text, zmq.auth.load_certificate(path)[1]]
    return [text]


def test_a_generator_s_disk_holds_nothing_of_the_learner_s(cluster):
    """What a generator (or anything of the run's user) can read in the keys folder: no
    learner password, keypair or signing key, nor a secret the learner's derives from."""
    run = provision(cluster)
    keys_dir = Path(cluster.keys_dir)
    on_disk = b"".join(path.read_bytes() for path in keys_dir.iterdir())
    for secret in secrets_of(run, "learner"):
        assert secret.encode() not in on_disk
    # a generator's machine: without server.key_secret (docs/security.md, CURVE)
    for path in (p for p in keys_dir.iterdir() if p.name != "server.key_secret"):
        for content in readable_secrets(path):
            seed = derive_seed(content, "learner")
            assert public_key(seed).hex() != run.group_publics["learner"], path.name
            assert verifier(content.decode()) != run.for_role("buffer").verifiers.get("learner")


def test_a_generator_started_by_hand_derives_the_same_group_key_it_would_be_handed(cluster):
    run = provision(cluster)
    from_disk = group_key(cluster, "generator")
    handed = run.for_role("generator")
    assert from_disk.seed.hex() == handed.group_seeds["generator"]
    assert from_disk.peer_public.hex() == handed.group_publics["learner"]
    assert (Path(cluster.keys_dir) / GROUP_KEY).read_text().strip() == run.group_publics["learner"]
    with pytest.raises(SecurityError, match="learner's group key is handed"):
        group_key(cluster, "learner")  # nobody derives the learner's from disk


def test_credentials_handed_over_a_pipe_are_read_once_and_held(tmp_path):
    run = provision(ClusterConfig(keys_dir=str(tmp_path / "keys")))
    given = run.for_role("learner")
    with handed_over(given) as handover:
        (fd,) = handover.fds
        assert handover.env == {CREDENTIALS_FD_ENV: str(fd)}
        os.environ[CREDENTIALS_FD_ENV] = str(os.dup(fd))  # as the child inherits it
        try:
            assert receive_handed() == given
        finally:
            os.environ.pop(CREDENTIALS_FD_ENV, None)
    assert CREDENTIALS_FD_ENV not in os.environ
    assert held(ClusterConfig(keys_dir=str(tmp_path / "keys"))) == given
    assert receive_handed() is None  # nothing handed: a role started by hand


def test_malformed_credentials_are_refused_in_a_line():
    with pytest.raises(SecurityError, match="credentials handed over are malformed"):
        Credentials.from_json(b'{"keys_dir": "/x"}')
    with pytest.raises(SecurityError, match="malformed"):
        Credentials.from_json(b"\xff")
