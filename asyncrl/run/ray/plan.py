"""The plan of a run on Ray, as pure functions of its config: what each actor asks for.

The learner ranks share a placement group, one bundle per rank, and bundle 0
also holds the buffer (:func:`learner_bundles`), so the buffer and the weights
publisher (learner rank 0) share a node and one advertised address serves
both; each generator replica asks for its pool's ``num_cpus`` / ``num_gpus``
(:func:`generator_replicas`). A local Ray offers exactly what the run asks for
(:func:`local_num_cpus`, :func:`local_resources`). Settings Ray cannot honour
are refused before anything starts (:func:`check_resources`).
"""

from __future__ import annotations

import math
from pathlib import Path

from asyncrl.config import Config
from asyncrl.core.paths import LEARNER_STORE_ENV, replica_name


def check_resources(config: Config) -> list[str]:
    """Settings that cannot work under Ray, one message each naming the keys."""
    problems = []
    learner = config.learner
    if learner.device == "cuda" and learner.num_gpus_per_rank == 0:
        problems.append(
            "learner.device=cuda with cluster.backend=ray needs learner.num_gpus_per_rank > 0: "
            "Ray hides GPUs from actors that do not ask for them"
        )
    reserved = sorted(set(learner.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
    if reserved:
        problems.append(
            f"learner.resources names {reserved}: ask for CPUs and GPUs with "
            "learner.num_cpus_per_rank and learner.num_gpus_per_rank"
        )
    if learner.num_gpus_per_rank > 1:
        problems.append(
            f"learner.num_gpus_per_rank={learner.num_gpus_per_rank:g}: a learner rank uses "
            "one GPU; run more ranks (learner.world_size) instead"
        )
    return problems


def learner_bundles(config: Config) -> list[dict[str, float]]:
    """One bundle per learner rank; bundle 0 also holds the buffer."""
    learner = config.learner
    bundles = []
    for rank in range(learner.world_size):
        cpus = learner.num_cpus_per_rank + (config.cluster.buffer_num_cpus if rank == 0 else 0)
        bundle = {"CPU": cpus, **learner.resources}
        if learner.num_gpus_per_rank:
            bundle["GPU"] = learner.num_gpus_per_rank
        bundles.append(bundle)
    return bundles


def generator_replicas(config: Config) -> list[tuple[str, str, int, float, float]]:
    """``(name, pool, index, num_cpus, num_gpus)`` of every generator replica."""
    replicas = []
    for pool in config.generators.resolved_pools():
        for index in range(pool.replicas):
            replicas.append(
                (replica_name(pool.name, index), pool.name, index, pool.settings.num_cpus,
                 pool.settings.num_gpus)
            )  # fmt: skip
    return replicas


def local_num_cpus(config: Config) -> int:
    """CPUs a local Ray offers: exactly what the run asks for (Ray's CPUs are logical)."""
    asked = sum(bundle["CPU"] for bundle in learner_bundles(config))
    asked += sum(cpus for *_, cpus, _ in generator_replicas(config))
    return max(1, math.ceil(asked))


def local_resources(config: Config) -> dict[str, float]:
    """Custom resources a local Ray offers: what the learner ranks ask for."""
    learner = config.learner
    return {key: value * learner.world_size for key, value in learner.resources.items()}


def advertise(config: Config, host: str, ports: dict[str, int]) -> Config:
    """``config`` with the endpoints' address and ports as every role must see them
    (``group_port`` among ``ports`` is the collective weight path's group store)."""
    ports = dict(ports)
    weights = config.weights
    if "group_port" in ports:
        weights = weights.model_copy(update={"group_port": ports.pop("group_port")})
    cluster = config.cluster.model_copy(update={"host": host, **ports})
    return config.model_copy(update={"cluster": cluster, "weights": weights})


def rank_env(
    rank: int,
    world_size: int,
    master_addr: str | None = None,
    master_port: int | None = None,
    store: Path | None = None,
) -> dict[str, str]:
    """A learner rank's process-group variables (:func:`asyncrl.learner.distributed.init`).

    One rank needs no more than these (its store lives in its process); ranks
    on one machine meet through the file ``store``; ranks across nodes through
    torch's TCPStore at ``master_addr:master_port``. ``LOCAL_RANK`` is 0: Ray
    gives each actor only its own GPUs, so a rank's GPU is always device 0 of
    those it sees.
    """
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    if store is not None:
        env[LEARNER_STORE_ENV] = str(store)
    if master_addr is not None:
        env |= {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
    return env
