"""A run's keys folder (``cluster.keys_dir``, by default ``RUN_DIR/keys``), and a run's credentials.

The folder holds only what a process started by hand needs, readable by the
run's user alone (folder 0700, secrets 0600)::

    on loopback (PLAIN; written at launch, kept by a resume)
    generator.secret    the generators' password: `asyncrl generator` joining a live run
    observer.secret     the observers' password: `asyncrl status`
    group.key           the learner's public key on the weight-update group (every launch)

    beyond loopback (CURVE; written by `asyncrl keys RUN_DIR`)
    server.key          the servers' public key: every machine
    server.key_secret   the servers' secret key: the buffer's and learner's machine
    client.key          the generators' and observers' public key: every machine
    client.key_secret   their secret key: every machine that runs a generator
    group.key           the learner's public key on the weight-update group

Nothing in it is the learner's: :func:`provision` makes the learner's
password (or CURVE keypair) afresh at every launch, and the launcher hands it
to the learner process alone (:mod:`asyncrl.core.credentials`). A CURVE learner's
group key is derived from the servers' secret key, which its machine holds
anyway, so that ``group.key`` need not be copied again after every launch.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth

from asyncrl.core.credentials import (
    GENERATOR,
    LEARNER,
    OBSERVER,
    Credentials,
    SecurityError,
    hold,
    verifier,
)
from asyncrl.core.signing import GroupKey, derive_seed, public_key

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

log = logging.getLogger("asyncrl.security")

KEYS = "keys"
"""The keys' folder inside a run directory (the default ``cluster.keys_dir``)."""
SERVER = "server"
CLIENT = "client"
CURVE_KEY_NAMES = (SERVER, CLIENT)
KEY_FILES = tuple(f"{name}.{kind}" for name in CURVE_KEY_NAMES for kind in ("key", "key_secret"))
GROUP_KEY = "group.key"
"""The learner's public key on the weight-update group, hex."""
STORED_ROLES = (GENERATOR, OBSERVER)
"""The roles whose loopback password is on disk: a process of theirs may be started by hand."""
PASSWORD_BYTES = 32
OBSOLETE = ("run.secret",)
"""The one secret every role used to derive its password from: removed at launch."""


def password_file(keys_dir: Path, role: str) -> Path:
    return keys_dir / f"{role}.secret"


@dataclass(frozen=True)
class CurveKeys:
    """The folder of a run's CURVE keys; each side loads the files it needs from it."""

    directory: Path

    def server_public(self) -> bytes:
        return self._load(f"{SERVER}.key")[0]

    def server_pair(self) -> tuple[bytes, bytes]:
        """``(public, secret)`` of the servers."""
        return self._secret_pair(SERVER)

    def client_pair(self) -> tuple[bytes, bytes]:
        """``(public, secret)`` of the generators and observers."""
        return self._secret_pair(CLIENT)

    def client_public(self) -> bytes:
        """The generators' and observers' public key."""
        return self._load(f"{CLIENT}.key")[0]

    def _secret_pair(self, name: str) -> tuple[bytes, bytes]:
        public, secret = self._load(f"{name}.key_secret")
        if secret is None:
            raise SecurityError(f"{self.directory / f'{name}.key_secret'} holds no secret key")
        return public, secret

    def _load(self, filename: str) -> tuple[bytes, bytes | None]:
        path = self.directory / filename
        if not path.is_file():
            raise SecurityError(
                f"CURVE key file {path} is missing: {how_to_create(self.directory)} "
                "(or copy them from the machine that created them; see docs/security.md)"
            )
        try:
            return zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise SecurityError(f"cannot read CURVE key file {path}: {error}") from None


def how_to_create(directory: Path) -> str:
    if directory.name == KEYS:
        return f"run `asyncrl keys {directory.parent}` first"
    return "run `asyncrl keys DIR` and point cluster.keys_dir at DIR/keys"


def _private_folder(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)  # only the owner may even list the secrets


# ---------------------------------------------------------------- writing


def generate_keys(directory: Path, force: bool = False) -> Path:
    """Write the servers' and the clients' keypairs (and ``group.key``) into
    ``directory/keys``; returns that folder.

    Refuses to replace existing keys unless ``force``: peers holding the old
    ones would be refused, and a running run would lose its way in.
    """
    keys = directory / KEYS
    existing = [name for name in KEY_FILES if (keys / name).exists()]
    if existing and not force:
        raise FileExistsError(
            f"{keys} already holds keys ({', '.join(existing)}); pass --force to replace "
            "them (every machine holding the old ones must then get the new ones)"
        )
    _private_folder(keys)
    for name in CURVE_KEY_NAMES:
        _, secret = zmq.auth.create_certificates(keys, name)
        os.chmod(secret, 0o600)
    _write_group_key(keys, public_key(_curve_learner_seed(CurveKeys(keys))))
    return keys


def _stored_password(path: Path) -> str:
    """The password in ``path``, written first (0600, never replaced) if there is none."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_password(path)
    with os.fdopen(descriptor, "w") as file:
        password = secrets.token_hex(PASSWORD_BYTES)
        file.write(password + "\n")
    return password


def _write_group_key(keys_dir: Path, public: bytes) -> None:
    path = keys_dir / GROUP_KEY
    if path.is_file() and path.read_text().strip() == public.hex():
        return
    staged = path.with_suffix(".partial")
    staged.write_text(public.hex() + "\n")
    staged.replace(path)  # a generator joining now reads the old key or the new, whole


def provision(cluster: ClusterConfig) -> Credentials:
    """Every credential of the run in ``cluster.keys_dir``, the learner's made afresh.

    Loopback: the generators' and observers' passwords are read from the
    folder (written the first time, so a resumed run and the generators that
    joined it keep theirs); the learner's is new and goes nowhere but into the
    returned value. CURVE: the keys ``asyncrl keys`` wrote, and a new learner
    keypair. Either way ``group.key`` is brought up to date for generators
    started by hand.
    """
    keys_dir = Path(cluster.keys_dir or "")
    if not cluster.keys_dir:
        raise SecurityError("cluster.keys_dir is empty: the launcher fills it in")
    if cluster.uses_curve:
        return _provision_curve(CurveKeys(keys_dir))
    _private_folder(keys_dir)
    for name in OBSOLETE:
        if (keys_dir / name).exists():
            (keys_dir / name).unlink()
            log.info("removed %s: every role now has credentials of its own", keys_dir / name)
    passwords = {role: _stored_password(password_file(keys_dir, role)) for role in STORED_ROLES}
    passwords[LEARNER] = secrets.token_hex(PASSWORD_BYTES)
    seeds = {
        GENERATOR: derive_seed(passwords[GENERATOR].encode(), GENERATOR),
        LEARNER: derive_seed(passwords[LEARNER].encode(), LEARNER),
    }
    _write_group_key(keys_dir, public_key(seeds[LEARNER]))
    return Credentials(
        str(keys_dir),
        passwords=passwords,
        verifiers={role: verifier(password) for role, password in passwords.items()},
        group_seeds={side: seed.hex() for side, seed in seeds.items()},
        group_publics={side: public_key(seed).hex() for side, seed in seeds.items()},
    )


def _provision_curve(keys: CurveKeys) -> Credentials:
    client_public, client_secret = keys.client_pair()
    learner_public, learner_secret = zmq.curve_keypair()
    seeds = {GENERATOR: derive_seed(client_secret, GENERATOR), LEARNER: _curve_learner_seed(keys)}
    _write_group_key(keys.directory, public_key(seeds[LEARNER]))
    if (keys.directory / "learner.key_secret").exists():
        log.warning(
            "%s is no longer used (the learner gets a new keypair at every launch): delete "
            "it and learner.key here and on every machine you copied them to",
            keys.directory / "learner.key_secret",
        )
    client = (client_public.decode(), client_secret.decode())
    return Credentials(
        str(keys.directory),
        curve_pairs={LEARNER: (learner_public.decode(), learner_secret.decode()),
                     GENERATOR: client, OBSERVER: client},
        curve_roles={client[0]: GENERATOR, learner_public.decode(): LEARNER},
        group_seeds={side: seed.hex() for side, seed in seeds.items()},
        group_publics={side: public_key(seed).hex() for side, seed in seeds.items()},
    )  # fmt: skip


def _curve_learner_seed(keys: CurveKeys) -> bytes:
    return derive_seed(keys.server_pair()[1], LEARNER)


def hold_every_role(cluster: ClusterConfig) -> Credentials:
    """Provision the run of ``cluster`` and hold all of its credentials in this process:
    for tests and benchmarks that play the buffer, the learner and generators at once."""
    credentials = provision(cluster)
    hold(credentials)
    return credentials


# ---------------------------------------------------------------- reading


def read_password(path: Path) -> str:
    """A stored password; SecurityError saying how to get one when it is missing."""
    if not path.is_file():
        raise SecurityError(
            f"the run's credentials {path} are missing: start the run with `asyncrl launch`, "
            "which writes them, or set cluster.keys_dir to the run's keys folder"
        )
    try:
        password = path.read_text().strip()
    except OSError as error:
        raise SecurityError(f"cannot read the run's credentials {path}: {error}") from None
    if len(password) < 2 * PASSWORD_BYTES:
        raise SecurityError(f"{path} holds no password (it is {len(password)} bytes)")
    return password


def stored_verifiers(keys_dir: Path) -> dict[str, str]:
    """Verifiers of the stored passwords: a server started by hand admits their roles."""
    found = {
        role: verifier(read_password(password_file(keys_dir, role)))
        for role in STORED_ROLES
        if password_file(keys_dir, role).is_file()
    }
    if not found:
        read_password(password_file(keys_dir, GENERATOR))  # raises, saying what to do
    return found


def stored_group_key(cluster: ClusterConfig) -> GroupKey:
    """A generator's side of the weight-update group, from the keys folder alone."""
    keys_dir = Path(cluster.keys_dir or "")
    if cluster.uses_curve:
        secret = CurveKeys(keys_dir).client_pair()[1]
    else:
        secret = read_password(password_file(keys_dir, GENERATOR)).encode()
    path = keys_dir / GROUP_KEY
    try:
        return GroupKey(derive_seed(secret, GENERATOR), bytes.fromhex(path.read_text().strip()))
    except FileNotFoundError:
        raise SecurityError(
            f"the learner's group key {path} is missing: it is written at launch "
            "(copy it from the launching machine's keys folder)"
        ) from None
    except (OSError, ValueError) as error:
        raise SecurityError(f"cannot read the learner's group key {path}: {error}") from None
