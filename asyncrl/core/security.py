"""Who may talk to a run's endpoints: servers, clients, and the roles they name.

A run's endpoints (the buffer's and the weights publisher's ROUTER sockets)
bind to 127.0.0.1 unless ``cluster.bind`` (or ``cluster.host``) names another
interface. Every peer authenticates, on loopback too (``cluster.auth``, on by
default), because any local process can reach a loopback port:

- on loopback, ZeroMQ PLAIN: each role logs in under its name with a password
  of its own, and servers check it against its verifier (its SHA-256);
- beyond loopback, ZeroMQ CURVE (``cluster.curve``, forced there): encrypted,
  the generators and observers with the client keypair ``asyncrl keys``
  wrote, the learner with a keypair made at every launch.

Which process holds which credential, and where each lives, is
:mod:`asyncrl.core.credentials` and :mod:`asyncrl.core.keys_folder`: no process holds
another role's secret, and the learner's is in no file.

The ZAP handler names each accepted peer by its role (``learner``,
``generator``, ``observer``); servers read it from every message
(:func:`peer_role`) and serve each role only its own requests: only the
learner may ask for batches or move the policy version.

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
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
from zmq.auth.thread import ThreadAuthenticator

from asyncrl.core.credentials import (
    GENERATOR,
    LEARNER,
    OBSERVER,
    ROLES,
    Credentials,
    Role,
    SecurityError,
    held,
)
from asyncrl.core.keys_folder import (
    KEY_FILES,
    KEYS,
    CurveKeys,
    generate_keys,
    how_to_create,
    password_file,
    provision,
    read_password,
    stored_verifiers,
)

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig, Config

__all__ = [
    "GENERATOR",
    "KEYS",
    "KEY_FILES",
    "LEARNER",
    "OBSERVER",
    "ROLES",
    "CurveKeys",
    "Role",
    "SecurityError",
    "client_context",
    "curve_keys",
    "generate_keys",
    "peer_role",
    "provision_run",
    "resolve_keys",
    "secure_client",
    "secure_server",
]

log = logging.getLogger("asyncrl.security")

LEARNER_IS_HANDED = (
    "the learner's credentials are made by `asyncrl launch` at every start and handed to "
    "the learner process alone (no file holds them): start the learner through the launcher"
)


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
    given. A loopback run is returned unchanged: its credentials are made once
    its run directory exists (:func:`provision_run`). Raises
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
            f"{how_to_create(directory)} (see docs/security.md)"
        )
    return _with_keys_dir(config, directory)


def provision_run(config: Config, run_dir: Path) -> tuple[Config, Credentials | None]:
    """Once the run directory exists: every credential of the run, the learner's new.

    Returns ``config`` with ``cluster.keys_dir`` absolute (by default
    ``run_dir/keys``) and the run's credentials, which the launcher hands out
    role by role (:meth:`~asyncrl.core.credentials.Credentials.for_role`); what the
    keys folder keeps is :func:`asyncrl.core.keys_folder.provision`'s. A run with
    ``cluster.auth`` off gets none (and a warning).
    """
    cluster = config.cluster
    if not cluster.auth:
        log.warning(
            "cluster.auth=false: any process on this machine may speak to the run's "
            "endpoints (feed the learner, read the weights); use it on trusted machines only"
        )
        return config, None
    directory = Path(cluster.keys_dir) if cluster.keys_dir else run_dir / KEYS
    config = _with_keys_dir(config, directory)
    return config, provision(config.cluster)


def _with_keys_dir(config: Config, directory: Path) -> Config:
    cluster = config.cluster.model_copy(update={"keys_dir": str(directory.resolve())})
    return config.model_copy(update={"cluster": cluster})


def _why(cluster: ClusterConfig) -> str:
    if not cluster.uses_curve:
        return "cluster.auth=true requires the run's credentials"
    if cluster.curve is True:
        return "cluster.curve=true requires CURVE keys"
    if cluster.joins_cluster:
        return (
            f"cluster.address={cluster.address} joins a Ray cluster, whose endpoints listen "
            "on a node's network address, so every connection needs CURVE keys"
        )
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

    PLAIN: the user name is the role; the password's SHA-256 must be that
    role's verifier (compared in constant time). CURVE: the client's public
    key picks the role.
    """

    def __init__(self, context: zmq.Context, verifiers: dict[str, str], keys: dict[bytes, Role]):
        super().__init__(context, log=log.getChild("zap"))
        self.passwords = {"*": {}}  # pyzmq's own table stays empty: we check below
        self.verifiers = {role: bytes.fromhex(digest) for role, digest in verifiers.items()}
        self.roles_by_key = keys
        self.refused: Counter[str] = Counter()

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        expected = self.verifiers.get(username)
        digest = hashlib.sha256(password.encode()).digest()
        if expected is not None and hmac.compare_digest(digest, expected):
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
    context: zmq.Context,
    socket: zmq.Socket,
    cluster: ClusterConfig,
    credentials: Credentials | None = None,
) -> ServerAuth | None:
    """Make ``socket`` (not yet bound) admit only the run's roles; None with ``cluster.auth`` off.

    ``credentials``: what this server admits; by default what this process
    was handed (:func:`~asyncrl.core.credentials.held`), else, for a server started
    by hand, the roles whose credentials are in the keys folder (never the
    learner). Starts the ZAP handler of ``context`` (one per context): without
    it libzmq would admit any client that knows the server's public key, or
    any PLAIN password. Stop the returned handler before ``context.term()``,
    which waits for its sockets.
    """
    if not cluster.auth:
        return None
    credentials = credentials or held(cluster)
    if cluster.uses_curve:
        _check_libzmq()
        keys = CurveKeys(_keys_dir(cluster))
        roles: dict[bytes, Role] = {keys.client_public(): GENERATOR}
        if credentials is not None:
            roles |= {key.encode(): role for key, role in credentials.curve_roles.items()}
        authenticator = RunAuthenticator(context, {}, roles)
        authenticator.configure_curve_callback("*", authenticator)
        public, secret = keys.server_pair()
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True
    else:
        if credentials is not None and credentials.verifiers:
            verifiers = dict(credentials.verifiers)
        else:
            verifiers = stored_verifiers(_keys_dir(cluster))
        authenticator = RunAuthenticator(context, verifiers, {})
        socket.plain_server = True
    authenticator.start()
    return ServerAuth(authenticator)


def secure_client(
    context: zmq.Context,
    cluster: ClusterConfig,
    role: Role,
    credentials: Credentials | None = None,
) -> zmq.Context:
    """Make every socket ``context`` creates from now on a client of the run as ``role``.

    ``credentials``: by default what this process was handed
    (:func:`~asyncrl.core.credentials.held`), else what the keys folder holds for
    ``role``; the learner's are only ever handed. Uses pyzmq's context-wide
    default socket options, so helpers that open or reopen sockets
    (``client_socket``, ``WeightClient``) need no credentials of their own.
    With ``cluster.auth`` off the context is returned unchanged.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if not cluster.auth:
        return context
    credentials = credentials or held(cluster)
    if cluster.uses_curve:
        _check_libzmq()
        keys = CurveKeys(_keys_dir(cluster))
        pair = credentials.curve_pairs.get(role) if credentials else None
        if pair is None and role == LEARNER:
            raise SecurityError(LEARNER_IS_HANDED)
        public, secret = (p.encode() for p in pair) if pair else keys.client_pair()
        context.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public())
        context.setsockopt(zmq.CURVE_PUBLICKEY, public)
        context.setsockopt(zmq.CURVE_SECRETKEY, secret)
    else:
        password = credentials.passwords.get(role) if credentials else None
        if password is None and role == LEARNER:
            raise SecurityError(LEARNER_IS_HANDED)
        if password is None:
            password = read_password(password_file(_keys_dir(cluster), role))
        context.setsockopt(zmq.PLAIN_USERNAME, role.encode())
        context.setsockopt(zmq.PLAIN_PASSWORD, password.encode())
    return context


def client_context(
    cluster: ClusterConfig, role: Role, credentials: Credentials | None = None
) -> zmq.Context:
    """A fresh context for a role's client sockets, with the run's credentials for ``role``."""
    context = zmq.Context()
    try:
        return secure_client(context, cluster, role, credentials)
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
