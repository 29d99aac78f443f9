"""Signatures on the weight-update group: each side signs with a key of its own.

The collective weight path's store has no authentication, so every message
through it is signed (:mod:`asyncrl.weights.collective.buckets`). One key
shared by both sides would let a generator, which must hold it, sign what only
the learner may say: an ``Accept`` that seats it as a replica's rank 0, or an
``Offer`` of a version it then feeds that replica. So each side holds an
Ed25519 signing key of its own and only the other side's public key: the
learner signs ``Accept``, ``Offer`` and ``UpToDate``; a replica signs
``JoinRequest`` and ``Ask``; each checks the other's signature (:class:`GroupKey`).

A side's signing key is derived from a credential its holder already has
(:func:`derive_seed`), so no extra secret is stored: a generator's from its
password (or CURVE secret key), the learner's from its own, which only the
learner process is handed (:mod:`asyncrl.core.credentials`).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

Side = Literal["learner", "generator"]
SIGNATURE_BYTES = 64
"""An Ed25519 signature."""
SEED_BYTES = 32
_LABEL = b"asyncrl weight-update group: "


def derive_seed(secret: bytes, side: Side) -> bytes:
    """``side``'s signing seed from a secret of its holder's (HMAC-SHA256, so the seed
    reveals nothing of the secret, and one secret gives each side a different seed)."""
    return hmac.new(secret, _LABEL + side.encode(), hashlib.sha256).digest()


def public_key(seed: bytes) -> bytes:
    """The 32-byte public key of the signing key ``seed``."""
    return Ed25519PrivateKey.from_private_bytes(seed).public_key().public_bytes_raw()


@dataclass(frozen=True)
class GroupKey:
    """One side's keys on the group: its own signing seed, and the other side's public key.

    Plain bytes, so a spawned replica process can be handed one (pickled).
    """

    seed: bytes
    peer_public: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_BYTES or len(self.peer_public) != SEED_BYTES:
            raise ValueError("a group key is a 32-byte seed and a 32-byte public key")

    def sign(self, data: bytes) -> bytes:
        """This side's signature of ``data``."""
        return Ed25519PrivateKey.from_private_bytes(self.seed).sign(data)

    def verify(self, signature: bytes, data: bytes) -> bool:
        """Whether the other side signed ``data``."""
        try:
            Ed25519PublicKey.from_public_bytes(self.peer_public).verify(signature, data)
        except InvalidSignature:
            return False
        return True


def group_key_pair(learner_seed: bytes, generator_seed: bytes) -> tuple[GroupKey, GroupKey]:
    """The learner's side and a replica's side of one group, from the two seeds."""
    learner = GroupKey(learner_seed, public_key(generator_seed))
    generator = GroupKey(generator_seed, public_key(learner_seed))
    return learner, generator
