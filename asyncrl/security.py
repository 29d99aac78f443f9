"""Who may talk to a run's endpoints: per-run credentials, servers, clients, roles.

A run's endpoints (the buffer's and the weights publisher's ROUTER sockets)
bind to 127.0.0.1 unless ``cluster.bind`` (or ``cluster.host``) names another
interface. Every peer authenticates, on loopback too (``cluster.auth``, on by
default), because any local process can reach a loopback port:

- on loopback, ZeroMQ PLAIN with a per-run secret: the launcher writes
  ``RUN_DIR/keys/run.secret`` (readable by the run's user only) and each role
  logs in as its role with the password ``HMAC(secret, role)``;
- beyond loopback, ZeroMQ CURVE (``cluster.curve``, forced there): encrypted,
  with one client keypair per role.

The ZAP handler names each accepted peer by its role (``learner``,
``generator``, ``observer``); servers read it from every message
(:func:`peer_role`) and serve each role only its own requests: only the
learner may ask for batches or move the policy version.

The keys live in one directory (``cluster.keys_dir``, default ``RUN_DIR/keys``),
written by ``asyncrl keys RUN_DIR``::

    server.key          public key of the servers: every client needs it
    server.key_secret   the servers' secret key (buffer and learner machines only)
    client.key          public key of the generators and observers (``asyncrl status``)
    client.key_secret   their secret key (every machine that runs a generator)
    learner.key         public key of the learner
    learner.key_secret  the learner's secret key (the learner's machines only)

Servers call :func:`secure_server` before binding; it starts a ZAP handler
(pyzmq's ``ThreadAuthenticator``) on the socket's context that admits only the
run's credentials, names each peer by its role and counts the peers it
refuses. Clients make their sockets from :func:`client_context`, whose sockets
all carry the credentials of one role.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig, Config

log = logging.getLogger("asyncrl.security")

KEYS = "keys"
"""The keys' folder inside a run directory (the default ``cluster.keys_dir``)."""
SERVER = "server"
CLIENT = "client"
LEARNER = "learner"
GENERATOR = "generator"
OBSERVER = "observer"
Role = Literal["learner", "generator", "observer"]
ROLES: tuple[Role, ...] = (LEARNER, GENERATOR, OBSERVER)
"""Who a peer is: the learner, a generator, or an observer (``asyncrl status``)."""
CURVE_KEY_NAMES = (SERVER, CLIENT, LEARNER)
KEY_FILES = tuple(f"{name}.{kind}" for name in CURVE_KEY_NAMES for kind in ("key", "key_secret"))
RUN_SECRET = "run.secret"
"""The per-run secret of a loopback run, inside the keys folder."""
SECRET_BYTES = 32


class SecurityError(RuntimeError):
    """CURVE is required but its keys are missing or unreadable; says how to fix it."""


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
        """``(public, secret)`` of the run's clients."""
        return self._secret_pair(CLIENT)

    def client_public(self) -> bytes:
        """The generators' and observers' public key."""
        return self._load(f"{CLIENT}.key")[0]

    def role_pair(self, role: Role) -> tuple[bytes, bytes]:
        """``(public, secret)`` a client of ``role`` connects with."""
        return self._secret_pair(LEARNER if role == LEARNER else CLIENT)

    def roles_by_key(self) -> dict[bytes, Role]:
        """z85 public key -> the role servers take its holder for."""
        return {self._load(f"{CLIENT}.key")[0]: GENERATOR, self._load(f"{LEARNER}.key")[0]: LEARNER}

    def _secret_pair(self, name: str) -> tuple[bytes, bytes]:
        public, secret = self._load(f"{name}.key_secret")
        if secret is None:
            raise SecurityError(f"{self.directory / f'{name}.key_secret'} holds no secret key")
        return public, secret

    def _load(self, filename: str) -> tuple[bytes, bytes | None]:
        path = self.directory / filename
        if not path.is_file():
            raise SecurityError(
                f"CURVE key file {path} is missing: {_how_to_create(self.directory)} "
                "(or copy them from the machine that created them; see docs/security.md)"
            )
        try:
            return zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise SecurityError(f"cannot read CURVE key file {path}: {error}") from None


# ---------------------------------------------------------------------- keys


def generate_keys(directory: Path, force: bool = False) -> Path:
    """Write the server, client and learner keypairs into ``directory/keys``; returns that folder.

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
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys.chmod(0o700)  # only the owner may even list the secrets
    for name in CURVE_KEY_NAMES:
        _, secret = zmq.auth.create_certificates(keys, name)
        os.chmod(secret, 0o600)
    return keys


def generate_run_secret(keys_dir: Path) -> Path:
    """Write a fresh per-run secret into ``keys_dir`` unless one is there; returns its path.

    An existing secret is kept: a resumed run, and generators that joined it,
    go on using the one they hold.
    """
    path = keys_dir / RUN_SECRET
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    if not path.exists():
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return path


def role_password(secret: bytes, role: Role) -> bytes:
    """The PLAIN password of ``role``: no role's password reveals another's."""
    return hmac.new(secret, role.encode(), hashlib.sha256).hexdigest().encode()


@dataclass(frozen=True)
class RunSecret:
    """The per-run secret of a loopback run (``keys_dir/run.secret``)."""

    path: Path

    def load(self) -> bytes:
        if not self.path.is_file():
            raise SecurityError(
                f"the run's secret {self.path} is missing: start the run with `asyncrl launch`, "
                "which writes it, or set cluster.keys_dir to the run's keys folder"
            )
        try:
            secret = self.path.read_text().strip().encode()
        except OSError as error:
            raise SecurityError(f"cannot read the run's secret {self.path}: {error}") from None
        if len(secret) < 2 * SECRET_BYTES:
            raise SecurityError(f"{self.path} holds no secret (it is {len(secret)} bytes)")
        return secret


def curve_keys(cluster: ClusterConfig) -> CurveKeys | None:
    """The run's keys when its connections use CURVE, else None."""
    if not cluster.uses_curve:
        return None
    return CurveKeys(_keys_dir(cluster))


def _keys_dir(cluster: ClusterConfig) -> Path:
    if not cluster.keys_dir:
        raise SecurityError(
            f"{_why(cluster)}, but cluster.keys_dir is empty: name the folder that "
            "`asyncrl keys DIR` wrote (DIR/keys), or start the run with `asyncrl launch`, "
            "which fills it in"
        )
    return Path(cluster.keys_dir)


def resolve_keys(config: Config, run_dir: Path | None) -> Config:
    """At launch, before anything starts: check the CURVE keys a CURVE run needs exist.

    Returns ``config`` with ``cluster.keys_dir`` made absolute (by default
    ``run_dir/keys``), so every role finds the keys from the config it is
    given. A loopback run is returned unchanged: its secret is written once its
    run directory exists (:func:`provision_run_secret`). Raises
    :class:`SecurityError` naming the config key and what to run.
    """
    cluster = config.cluster
    if not cluster.uses_curve:
        return config
    if cluster.keys_dir:
        directory = Path(cluster.keys_dir)
    elif run_dir is not None:
        directory = run_dir / KEYS
    else:
        raise SecurityError(
            f"{_why(cluster)}, and a new run directory has no keys: run "
            "`asyncrl keys RUN_DIR`, then `asyncrl launch ... --run-dir RUN_DIR` "
            "(or set cluster.keys_dir to a folder of keys)"
        )
    missing = [name for name in KEY_FILES if not (directory / name).is_file()]
    if missing:
        where = f"cluster.keys_dir={directory}" if cluster.keys_dir else str(directory)
        raise SecurityError(
            f"{_why(cluster)}, but {where} lacks {', '.join(missing)}: "
            f"{_how_to_create(directory)} (see docs/security.md)"
        )
    return _with_keys_dir(config, directory)


def provision_run_secret(config: Config, run_dir: Path) -> Config:
    """Once the run directory exists: give a loopback run its per-run secret.

    Writes ``keys_dir/run.secret`` (by default ``run_dir/keys``) unless it is
    there (a resumed run keeps its own) and returns ``config`` with
    ``cluster.keys_dir`` absolute. CURVE runs and runs with ``cluster.auth``
    off are returned unchanged (the latter with a warning).
    """
    cluster = config.cluster
    if not cluster.auth:
        log.warning(
            "cluster.auth=false: any process on this machine may speak to the run's "
            "endpoints (feed the learner, read the weights); use it on trusted machines only"
        )
        return config
    if cluster.uses_curve:
        return config
    directory = Path(cluster.keys_dir) if cluster.keys_dir else run_dir / KEYS
    generate_run_secret(directory)
    return _with_keys_dir(config, directory)


def _with_keys_dir(config: Config, directory: Path) -> Config:
    cluster = config.cluster.model_copy(update={"keys_dir": str(directory.resolve())})
    return config.model_copy(update={"cluster": cluster})


def _how_to_create(directory: Path) -> str:
    if directory.name == KEYS:
        return f"run `asyncrl keys {directory.parent}` first"
    return "run `asyncrl keys DIR` and point cluster.keys_dir at DIR/keys"


def _why(cluster: ClusterConfig) -> str:
    if not cluster.uses_curve:
        return "cluster.auth=true requires the run's secret"
    if cluster.curve is True:
        return "cluster.curve=true requires CURVE keys"
    return (
        f"cluster.bind={cluster.bind_address} is not a loopback interface, so every "
        "connection needs CURVE keys"
    )


# ---------------------------------------------------------------------- sockets


def _check_libzmq() -> None:
    if not zmq.has("curve"):
        raise SecurityError(
            f"this libzmq ({zmq.zmq_version()}) was built without CURVE: install a pyzmq "
            "wheel (they bundle libsodium) or bind to 127.0.0.1"
        )


class RunAuthenticator(ThreadAuthenticator):
    """The ZAP handler of one server: admits the run's roles, names them, counts the rest.

    PLAIN: the user name is the role, checked against its HMAC password in
    constant time. CURVE: the client's public key picks the role.
    """

    def __init__(self, context: zmq.Context, passwords: dict[str, bytes], keys: dict[bytes, Role]):
        super().__init__(context, log=log.getChild("zap"))
        self.passwords = {"*": {}}  # pyzmq's own table stays empty: we check below
        self.role_passwords = passwords
        self.roles_by_key = keys
        self.refused: Counter[str] = Counter()

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = self.role_passwords.get(username)
        if expected is not None and hmac.compare_digest(password.encode(), expected):
            return True, b"OK"
        self._refuse("plain", f"a PLAIN peer with a wrong password for {username[:40]!r}")
        return False, b"Invalid credentials"

    def curve_user_id(self, client_public_key: bytes) -> str:
        from zmq.utils import z85

        return self.roles_by_key[z85.encode(client_public_key)]

    def callback(self, domain: str, key: bytes) -> bool:
        """CURVE credentials check (``configure_curve_callback``); ``key`` is z85."""
        if key in self.roles_by_key:
            return True
        self._refuse("curve", f"a peer with an unknown CURVE key {key.decode('ascii')}")
        return False

    def _refuse(self, kind: str, what: str) -> None:
        if not self.refused[kind]:  # once per kind: a stranger must not flood the log
            log.warning("refused %s (further refusals are only counted)", what)
        self.refused[kind] += 1


class ServerAuth:
    """The ZAP handler of one server's context: stop it after closing the socket."""

    def __init__(self, authenticator: RunAuthenticator):
        self.authenticator = authenticator

    @property
    def refused(self) -> int:
        """Handshakes refused for unknown credentials."""
        return sum(self.authenticator.refused.values())

    def stop(self) -> None:
        self.authenticator.stop()


def secure_server(
    context: zmq.Context, socket: zmq.Socket, cluster: ClusterConfig
) -> ServerAuth | None:
    """Make ``socket`` (not yet bound) admit only the run's roles; None with ``cluster.auth`` off.

    Starts the ZAP handler of ``context`` (one per context): without it libzmq
    would admit any client that knows the server's public key, or any PLAIN
    password. Stop the returned handler before ``context.term()``, which waits
    for its sockets.
    """
    if not cluster.auth:
        return None
    if cluster.uses_curve:
        _check_libzmq()
        keys = CurveKeys(_keys_dir(cluster))
        authenticator = RunAuthenticator(context, {}, keys.roles_by_key())
        authenticator.configure_curve_callback("*", authenticator)
        public, secret = keys.server_pair()
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True
    else:
        secret = RunSecret(_keys_dir(cluster) / RUN_SECRET).load()
        passwords = {role: role_password(secret, role) for role in ROLES}
        authenticator = RunAuthenticator(context, passwords, {})
        socket.plain_server = True
    authenticator.start()
    return ServerAuth(authenticator)


def secure_client(context: zmq.Context, cluster: ClusterConfig, role: Role) -> zmq.Context:
    """Make every socket ``context`` creates from now on a client of the run as ``role``.

    Uses pyzmq's context-wide default socket options, so helpers that open or
    reopen sockets (``client_socket``, ``WeightClient``) need no credentials of
    their own. With ``cluster.auth`` off the context is returned unchanged.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if not cluster.auth:
        return context
    if cluster.uses_curve:
        _check_libzmq()
        keys = CurveKeys(_keys_dir(cluster))
        public, secret = keys.role_pair(role)
        context.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public())
        context.setsockopt(zmq.CURVE_PUBLICKEY, public)
        context.setsockopt(zmq.CURVE_SECRETKEY, secret)
    else:
        secret = RunSecret(_keys_dir(cluster) / RUN_SECRET).load()
        context.setsockopt(zmq.PLAIN_USERNAME, role.encode())
        context.setsockopt(zmq.PLAIN_PASSWORD, role_password(secret, role))
    return context


def client_context(cluster: ClusterConfig, role: Role) -> zmq.Context:
    """A fresh context for a role's client sockets, with the run's credentials for ``role``."""
    context = zmq.Context()
    try:
        return secure_client(context, cluster, role)
    except BaseException:
        context.term()
        raise


def peer_role(frame: zmq.Frame) -> Role | None:
    """The role the server's ZAP handler admitted the sender of ``frame`` as.

    ``frame`` is any frame of a message received with ``copy=False``. None when
    the socket has no authentication (``cluster.auth`` off): every role is
    then taken at its word.
    """
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no ZAP handler: the property does not exist
        return None
    return user if user in ROLES else None
