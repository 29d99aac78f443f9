"""ZeroMQ CURVE for endpoints reachable from other machines: keys, servers, clients.

A run's endpoints (the buffer's and the weights publisher's ROUTER sockets)
bind to 127.0.0.1 unless ``cluster.bind`` (or ``cluster.host``) names another
interface. Anything a network peer can reach is encrypted and authenticated
with CURVE (``cluster.curve``, on by default beyond loopback), because the
wire protocol trusts its peers: a stranger could otherwise feed the learner
trajectories or read the weights.

The keys live in one directory (``cluster.keys_dir``, default ``RUN_DIR/keys``),
written by ``asyncrl keys RUN_DIR``::

    server.key          public key of the servers: every client needs it
    server.key_secret   the servers' secret key (buffer and learner machines only)
    client.key          public key of the run's clients: the only one servers admit
    client.key_secret   the clients' secret key (every machine that runs a role)

Servers call :func:`secure_server` before binding; it starts a ZAP handler
(pyzmq's ``ThreadAuthenticator``) on the socket's context that admits only the
key in ``client.key`` and counts the peers it refuses. Clients make their
sockets from :func:`client_context`, whose sockets all carry the client keys.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
KEY_FILES = (f"{SERVER}.key", f"{SERVER}.key_secret", f"{CLIENT}.key", f"{CLIENT}.key_secret")


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
        """The one client key servers admit."""
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
                f"CURVE key file {path} is missing: {_how_to_create(self.directory)} "
                "(or copy them from the machine that created them; see docs/security.md)"
            )
        try:
            return zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise SecurityError(f"cannot read CURVE key file {path}: {error}") from None


# ---------------------------------------------------------------------- keys


def generate_keys(directory: Path, force: bool = False) -> Path:
    """Write a server and a client keypair into ``directory/keys``; returns that folder.

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
    for name in (SERVER, CLIENT):
        _, secret = zmq.auth.create_certificates(keys, name)
        os.chmod(secret, 0o600)
    return keys


def curve_keys(cluster: ClusterConfig) -> CurveKeys | None:
    """The run's keys when its connections use CURVE, else None."""
    if not cluster.uses_curve:
        return None
    if not cluster.keys_dir:
        raise SecurityError(
            f"{_why(cluster)}, but cluster.keys_dir is empty: name the folder that "
            "`asyncrl keys DIR` wrote (DIR/keys), or start the run with `asyncrl launch`, "
            "which fills it in"
        )
    return CurveKeys(Path(cluster.keys_dir))


def resolve_keys(config: Config, run_dir: Path | None) -> Config:
    """At launch, before anything starts: check the keys a CURVE run needs exist.

    Returns ``config`` with ``cluster.keys_dir`` made absolute (by default
    ``run_dir/keys``), so every role finds the keys from the saved config.
    Raises :class:`SecurityError` naming the config key and what to run.
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
    keys = str(directory.resolve())
    return config.model_copy(update={"cluster": cluster.model_copy(update={"keys_dir": keys})})


def _how_to_create(directory: Path) -> str:
    if directory.name == KEYS:
        return f"run `asyncrl keys {directory.parent}` first"
    return "run `asyncrl keys DIR` and point cluster.keys_dir at DIR/keys"


def _why(cluster: ClusterConfig) -> str:
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


class AllowedClients:
    """ZAP credentials check: admits only the run's client key, counts the rest."""

    def __init__(self, allowed: set[bytes]):
        self.allowed = allowed
        """z85-encoded public keys."""
        self.refused: Counter[bytes] = Counter()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if not self.refused[key]:
            log.warning("refused a peer with an unknown CURVE key %s", key.decode("ascii"))
        self.refused[key] += 1
        return False


class ServerAuth:
    """The ZAP handler of one server's context: stop it after closing the socket."""

    def __init__(self, authenticator: ThreadAuthenticator, clients: AllowedClients):
        self.authenticator = authenticator
        self.clients = clients

    @property
    def refused(self) -> int:
        """Handshakes refused for an unknown client key."""
        return sum(self.clients.refused.values())

    def stop(self) -> None:
        self.authenticator.stop()


def secure_server(context: zmq.Context, socket: zmq.Socket, keys: CurveKeys) -> ServerAuth:
    """Make ``socket`` (not yet bound) a CURVE server admitting only the run's client key.

    Starts the ZAP handler of ``context`` (one per context): without it libzmq
    would admit any client that knows the server's public key. Stop the
    returned handler before ``context.term()``, which waits for its sockets.
    """
    _check_libzmq()
    public, secret = keys.server_pair()
    clients = AllowedClients({keys.client_public()})
    authenticator = ThreadAuthenticator(context, log=log.getChild("zap"))
    authenticator.configure_curve_callback("*", clients)
    authenticator.start()
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return ServerAuth(authenticator, clients)


def secure_client(context: zmq.Context, keys: CurveKeys | None) -> zmq.Context:
    """Make every socket ``context`` creates from now on a CURVE client of the run.

    Uses pyzmq's context-wide default socket options, so helpers that open or
    reopen sockets (``client_socket``, ``WeightClient``) need no keys of their
    own. With ``keys`` None the context is returned unchanged.
    """
    if keys is None:
        return context
    _check_libzmq()
    public, secret = keys.client_pair()
    context.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public())
    context.setsockopt(zmq.CURVE_PUBLICKEY, public)
    context.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return context


def client_context(cluster: ClusterConfig) -> zmq.Context:
    """A fresh context for a role's client sockets, with the run's CURVE keys when it has them."""
    keys = curve_keys(cluster)
    context = zmq.Context()
    try:
        return secure_client(context, keys)
    except BaseException:
        context.term()
        raise
