"""How new weights reach the generators: the path tried first, and the deadline of a sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt

from asyncrl.config.base import Section
from asyncrl.config.environment import DAY_S, Float

MIB = 1 << 20


class WeightsConfig(Section):
    """The weight-sync paths, fastest first: ``collective`` (a gloo/NCCL broadcast from
    learner rank 0 straight into each engine), ``shm`` (one shared-memory copy per version
    on this host, read in place), ``zmq`` (chunked pulls over ZeroMQ: any machine, always
    there). A replica tries the configured path, and on any failure or a missed deadline
    falls back to the next one down, ending at zmq."""

    transport: Literal["zmq", "shm", "collective"] = "shm"
    """The first path a replica tries (docs/generators.md, "Weight sync"). ``shm`` by
    default: a replica on the learner's host reads each version from shared memory, one
    elsewhere (or where /dev/shm cannot hold two copies of the policy) falls to ``zmq``."""
    deadline_s: Float = Field(120.0, gt=0.0, le=DAY_S)
    """Time limit of one weight transfer on any path; a transfer that misses it is
    cancelled, counted and logged, and the replica falls back to the next path."""
    bucket_bytes: StrictInt = Field(64 * MIB, ge=MIB, le=1 << 34)
    """collective: bytes per broadcast bucket (tensors are packed into flat buckets)."""
    group_port: StrictInt = Field(0, ge=0, le=65535)
    """collective: the rendezvous port of the weight-update groups; 0 picks a free one."""
