"""Where the endpoints listen and how peers reach and authenticate them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, model_validator

from asyncrl.config.base import Section
from asyncrl.config.environment import Float


class ClusterConfig(Section):
    """Where the endpoints listen and how peers reach them (see docs/security.md)."""

    backend: Literal["local", "ray"] = "local"
    """`local`: one process per role on this machine; `ray`: each role a Ray actor placed by
    the resources it asks for (docs/ray.md)."""
    address: str | None = None
    """ray: the cluster to join (`auto`, `HOST:6379`); empty: a local Ray on 127.0.0.1."""
    pin_cores: Literal["auto"] | bool = "auto"
    """local: give each learner rank and generator replica cores of its own, as many as its
    `num_threads` while they fit (else fewer, one torch thread per core); the buffer and
    helpers run anywhere (asyncrl/core/cores.py). `auto`: when every one can have a core;
    `true`: refuse to start otherwise; `false`: leave placement to the operating system."""
    buffer_num_cpus: Float = Field(1.0, ge=0.0)
    """ray: CPUs the buffer asks for; it is placed beside learner rank 0."""
    host: str = "127.0.0.1"
    """Address the roles connect to: the buffer's and learner's machine as the others reach it."""
    bind: str | None = None
    """Interface the buffer and weights endpoints listen on (`0.0.0.0`: all); empty: `host`.
    Anything but loopback needs CURVE keys: `asyncrl keys RUN_DIR`."""
    buffer_port: StrictInt = Field(0, ge=0, le=65535)
    """0 picks a free port at launch."""
    weights_port: StrictInt = Field(0, ge=0, le=65535)
    curve: bool | Literal["auto"] = "auto"
    """Encrypt and authenticate every connection with ZeroMQ CURVE; `auto`: when `bind`
    is not loopback (it cannot be turned off there)."""
    keys_dir: str | None = None
    """Folder of the credentials a process started by hand needs: the generators' and
    observers' passwords the launcher writes (loopback), or the CURVE keys `asyncrl keys DIR`
    writes into DIR/keys; empty: RUN_DIR/keys. The learner's are in no file."""
    auth: bool = True
    """Every peer proves it belongs to the run with its own role's credentials (loopback:
    a password per role; beyond: CURVE) and is served only its role's requests. false: any
    local process may feed the learner and read the weights (trusted single-user machines
    only; it cannot be turned off beyond loopback)."""

    @property
    def bind_address(self) -> str:
        return self.bind or self.host

    @property
    def binds_loopback(self) -> bool:
        """True when only this machine can reach the endpoints; a host name counts as not."""
        return _is_loopback(self.bind_address)

    @property
    def joins_cluster(self) -> bool:
        """True when the run joins a Ray cluster beyond this machine's loopback: its
        endpoints are then advertised on a node's network address, decided only once the
        buffer is placed, so its credentials must be CURVE's from the start."""
        if self.backend != "ray" or not self.address:
            return False
        host = self.address.rsplit(":", 1)[0] if ":" in self.address else self.address
        return not _is_loopback(host)  # `auto` or a host name: the cluster may span machines

    @property
    def uses_curve(self) -> bool:
        return self.curve is True or not self.binds_loopback or self.joins_cluster

    @model_validator(mode="after")
    def _curve_beyond_loopback(self) -> ClusterConfig:
        if not self.auth and self.uses_curve:
            where = (
                f"cluster.address={self.address}"
                if self.joins_cluster
                else f"cluster.bind={self.bind_address}"
            )
            raise ValueError(
                f"cluster.auth=false with {where}"
                f"{' and cluster.curve=true' if self.curve is True else ''}: CURVE "
                "authenticates every peer; drop cluster.auth, or bind to 127.0.0.1 without curve"
            )
        if self.curve is False and self.joins_cluster:
            raise ValueError(
                f"cluster.curve=false with cluster.address={self.address}: the endpoints of "
                "a run on a Ray cluster listen on a node's network address and must use CURVE "
                "keys; drop cluster.curve (auto) and run `asyncrl keys RUN_DIR`"
            )
        if self.curve is False and not self.binds_loopback:
            raise ValueError(
                f"cluster.curve=false with cluster.bind={self.bind_address}: an endpoint "
                "other machines can reach must use CURVE keys; drop cluster.curve (auto) "
                "and run `asyncrl keys RUN_DIR`, or bind to 127.0.0.1"
            )
        return self


def _is_loopback(address: str) -> bool:
    """``localhost`` or a loopback address; a host name or ``*`` counts as reachable."""
    import ipaddress

    address = address.strip("[]")
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
