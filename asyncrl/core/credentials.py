"""What each process of a run holds to prove who it is, and how it gets it.

A run's peers are the learner, the generators and observers (``asyncrl
status``); its servers are the buffer and the learner's weights publisher.
Each process gets its own role's credentials and nothing else
(:meth:`Credentials.for_role`):

    process    logs in with              its servers admit     weight-update group
    buffer     -                         verifiers of all      -
    learner    the learner's password    verifiers of all      learner's signing key,
               (CURVE: its keypair)      (CURVE: public keys)  generators' public key
    generator  the generators' password  -                     generators' signing key,
               (CURVE: client keypair)                         learner's public key
    observer   the observers' password   -                     -

A verifier is the SHA-256 of a password: it admits the password's holder and
cannot be turned back into it.

Where each lives. What a process started by hand needs is in the keys folder
(:mod:`asyncrl.core.keys_folder`): the generators' and observers' credentials, for
``asyncrl generator`` joining a live run and for ``asyncrl status``. The
learner's are made afresh by the launcher at every start and never written
anywhere. The launcher hands each process it starts its own over a pipe the
child inherits (:func:`handed_over`; the child reads it once,
:func:`receive_handed`), or, on Ray, as an argument of the actor call that runs
the role. So no file holds what would let a generator pose as the learner, and
the sandbox, which sees no run directory, sees none of it either.

A process keeps what it was handed with :func:`hold`; the sockets
(:mod:`asyncrl.core.security`) find it by the run's keys folder (:func:`held`). A
test or benchmark that plays every role holds a whole run's credentials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

LEARNER = "learner"
GENERATOR = "generator"
OBSERVER = "observer"
BUFFER = "buffer"
Role = Literal["learner", "generator", "observer"]
ROLES: tuple[Role, ...] = (LEARNER, GENERATOR, OBSERVER)
"""Who a peer is: the learner, a generator, or an observer (``asyncrl status``)."""
ProcessRole = Literal["buffer", "learner", "generator", "observer"]
PROCESS_ROLES: tuple[ProcessRole, ...] = (BUFFER, *ROLES)

CREDENTIALS_FD_ENV = "ASYNCRL_CREDENTIALS_FD"
"""The number of the inherited pipe a started role reads its credentials from."""
MAX_HANDED_BYTES = 16 * 1024
"""A run's credentials as JSON are about 1 KB; a pipe holds 64 KiB without a reader."""


class SecurityError(RuntimeError):
    """A process lacks credentials it needs, or cannot read them; says how to fix it."""


def verifier(password: str) -> str:
    """What a server keeps of a password: its SHA-256, hex."""
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True)
class Credentials:
    """Secrets and public values of one run, as one process holds them (hex, z85 text)."""

    keys_dir: str
    """The run's keys folder: the credentials are found by it (:func:`held`)."""
    passwords: Mapping[str, str] = field(default_factory=dict)
    """PLAIN: role -> the password it logs in with."""
    verifiers: Mapping[str, str] = field(default_factory=dict)
    """PLAIN: role -> :func:`verifier` of its password, which servers check."""
    curve_pairs: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """CURVE: role -> ``(public, secret)`` z85 client keypair it connects with."""
    curve_roles: Mapping[str, str] = field(default_factory=dict)
    """CURVE: z85 public key -> the role servers admit its holder as."""
    group_seeds: Mapping[str, str] = field(default_factory=dict)
    """Weight-update group: side -> its Ed25519 signing seed (:mod:`asyncrl.core.signing`)."""
    group_publics: Mapping[str, str] = field(default_factory=dict)
    """Weight-update group: side -> its public key."""

    def for_role(self, role: str) -> Credentials:
        """What a process of ``role`` is given: its own secrets, and public values only."""
        if role not in PROCESS_ROLES:
            raise ValueError(f"unknown role {role!r}: one of {', '.join(PROCESS_ROLES)}")
        own = () if role == BUFFER else (role,)
        serves = role in (BUFFER, LEARNER)  # the buffer, and the learner's weights publisher

        def only(values: Mapping[str, object]) -> dict:
            return {key: value for key, value in values.items() if key in own}

        signs = role in (LEARNER, GENERATOR)
        return Credentials(
            self.keys_dir,
            passwords=only(self.passwords),
            verifiers=dict(self.verifiers) if serves else {},
            curve_pairs=only(self.curve_pairs),
            curve_roles=dict(self.curve_roles) if serves else {},
            group_seeds=only(self.group_seeds) if signs else {},
            group_publics=dict(self.group_publics) if signs else {},
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Credentials:
        """Raises SecurityError when ``text`` is not what :meth:`to_json` writes."""
        try:
            fields = json.loads(text)
            pairs = {role: tuple(pair) for role, pair in fields.pop("curve_pairs").items()}
            return cls(**fields, curve_pairs=pairs)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise SecurityError(f"the credentials handed over are malformed: {error}") from None


# ----------------------------------------------------------------- holding


_HELD: dict[str, Credentials] = {}


def hold(credentials: Credentials) -> None:
    """Keep ``credentials`` for this process's sockets of their run."""
    _HELD[os.path.abspath(credentials.keys_dir)] = credentials


def held(cluster: ClusterConfig) -> Credentials | None:
    """What this process was handed for the run of ``cluster`` (None: nothing; a process
    started by hand then reads what it may from the keys folder)."""
    if not cluster.keys_dir:
        return None
    return _HELD.get(os.path.abspath(cluster.keys_dir))


# --------------------------------------------------------------- handing over


@dataclass(frozen=True)
class Handover:
    """What to start a child with so it inherits its credentials: ``env`` added to its
    environment (only the pipe's number) and ``fds`` passed to it (``pass_fds``)."""

    env: dict[str, str]
    fds: tuple[int, ...]


@contextlib.contextmanager
def handed_over(credentials: Credentials | None) -> Iterator[Handover]:
    """A pipe already holding ``credentials`` for the child started in this block.

    The parent writes and closes its end before the child starts, and closes
    the child's end once the block ends: the secrets are then in the pipe
    alone until the child reads them, never in a file, a command line or an
    environment (``/proc/PID/environ`` outlives ``os.environ.pop``).
    """
    if credentials is None:
        yield Handover({}, ())
        return
    data = credentials.to_json().encode()
    if len(data) > MAX_HANDED_BYTES:  # a full pipe would block the parent: never for 1 KB
        raise ValueError(f"{len(data)} bytes of credentials: at most {MAX_HANDED_BYTES}")
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb") as pipe:
            pipe.write(data)
        yield Handover({CREDENTIALS_FD_ENV: str(read)}, (read,))
    finally:
        os.close(read)


def receive_handed() -> Credentials | None:
    """In a started role: read the credentials the launcher handed over, close the pipe
    and hold them (:func:`hold`); None when it handed none (a role started by hand)."""
    number = os.environ.pop(CREDENTIALS_FD_ENV, None)
    if number is None:
        return None
    try:
        with os.fdopen(int(number), "rb") as pipe:
            data = pipe.read(MAX_HANDED_BYTES + 1)
    except (OSError, ValueError) as error:
        raise SecurityError(
            f"cannot read the credentials handed over ({CREDENTIALS_FD_ENV}={number}): {error}"
        ) from None
    credentials = Credentials.from_json(data)
    hold(credentials)
    return credentials
