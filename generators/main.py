"""A generator process: build the policy and backend, join the run, loop, leave.

The launcher starts one with :func:`run` (endpoints from the run's config); a
replica started by hand joins a live run with :func:`join` (the buffer tells it
where the weights are). Both end in :func:`serve`, which turns SIGTERM or
SIGINT (:class:`~asyncrl.core.stop_signals.StopSignals`) into the replica's
``stopping``: the loop ends at the next chunk, and the replica says ``Leave`` so
the buffer hands its unfinished groups out at once. The loop itself is
:class:`~asyncrl.generators.worker.GeneratorReplica`.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import torch

from asyncrl.config import Config
from asyncrl.core.cores import torch_threads
from asyncrl.core.messages import Join, Joined, new_incarnation
from asyncrl.core.paths import replica_name
from asyncrl.core.security import GENERATOR, client_context
from asyncrl.core.stop_signals import ROLE_SIGNALS, StopSignals
from asyncrl.core.transport import RequestClient, tcp
from asyncrl.generation.envs.formatting import (
    TemplateFormatError,
    TemplateFormatter,
    build_formatter,
)
from asyncrl.generation.models import build_policy
from asyncrl.generators.engines import build_backend
from asyncrl.generators.liveness import HeartbeatThread
from asyncrl.generators.worker import GeneratorReplica
from asyncrl.weights.collective.receiver import replica_source

log = logging.getLogger("asyncrl.generator")


def template_end_of_turn(tokenizer) -> list[str]:
    """The chat template's end-of-turn marker as a stop string, when it is not EOS.

    A response to a chat prompt ends where the template closes the assistant's
    turn. That is EOS for ChatML models (SmolLM2, Qwen: ``<|im_end|>``) but not for
    all (Llama-3's ``<|eot_id|>`` beside EOS ``<|end_of_text|>``): without the
    marker such a model would write the next turn itself. Nothing for a tokenizer
    without a chat template, or one whose turns cannot be told apart.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        marker = TemplateFormatter(tokenizer).end_of_turn
    except TemplateFormatError as error:
        log.warning("no end-of-turn stop string from the chat template: %s", error)
        return []
    return [] if not marker or marker == tokenizer.eos_token else [marker]


def generator_id(pool: str, index: int, restarts: int = 0) -> str:
    """``gen-0`` (default pool), ``fast-1`` (pool ``fast``); ``-r2`` after two restarts,
    so the buffer never takes a restarted replica for the one that died."""
    name = f"gen-{index}" if pool == "default" else f"{pool}-{index}"
    return f"{name}-r{restarts}" if restarts else name


def pool_config(config: Config, pool: str) -> Config:
    """``config`` with ``generators`` replaced by pool ``pool``'s effective settings."""
    for candidate in config.generators.resolved_pools():
        if candidate.name == pool:
            return config.model_copy(update={"generators": candidate.settings})
    names = [candidate.name for candidate in config.generators.resolved_pools()]
    raise ValueError(f"no generator pool named {pool!r}; the config has {names}")


def run(
    config: Config,
    run_dir: Path,
    replica_index: int,
    *,
    pool: str = "default",
    restarts: int = 0,
) -> None:
    """A replica the launcher started: endpoints from the run's config."""
    cluster = config.cluster
    work_dir = run_dir / replica_name(pool, replica_index)
    serve(
        config,
        generator_id(pool, replica_index, restarts),
        pool,
        tcp(cluster.host, cluster.buffer_port),
        lambda _joined: tcp(cluster.host, cluster.weights_port),
        work_dir,
        seed=config.run.seed * 1000 + replica_index + 1 + 7919 * restarts,
        restarts=restarts,
        run_dir=run_dir,  # the learner's: shared-memory weights when on its host
        learner_host=cluster.host,
    )


def join(config: Config, buffer_endpoint: str, pool: str, work_dir: Path) -> None:
    """A replica started by hand (``asyncrl generator``) that joins a live run: the buffer
    tells it where the weights are published (at the buffer's host)."""
    host = urlsplit(buffer_endpoint).hostname
    if not buffer_endpoint.startswith("tcp://") or host is None:
        raise ValueError(f"--buffer must look like tcp://HOST:PORT, got {buffer_endpoint!r}")
    name = f"{pool}-{socket.gethostname()}-{os.getpid()}"
    serve(
        config,
        name,
        pool,
        buffer_endpoint,
        lambda joined: tcp(host, joined.weights_port),
        work_dir / name,
        seed=config.run.seed * 1000 + os.getpid(),
        learner_host=host,  # the collective path needs weights.group_port set in its config
    )


def serve(
    config: Config,
    name: str,
    pool: str,
    buffer_endpoint: str,
    weights_endpoint: Callable[[Joined], str],
    work_dir: Path,
    *,
    seed: int,
    restarts: int = 0,
    run_dir: Path | None = None,
    learner_host: str | None = None,
) -> None:
    """Build the backend, join the run at ``buffer_endpoint``, generate until stopped,
    then leave (so the buffer hands this replica's unfinished groups out at once).
    ``run_dir``: the learner's run dir (None for a replica joined by hand: no shm path);
    ``learner_host``: where the collective path's group is (with ``weights.transport:
    collective``)."""
    config = pool_config(config, pool)
    torch.set_num_threads(torch_threads(config.generators.num_threads))
    model, tokenizer = build_policy(config.model, config.run.seed)
    if config.environment is not None:  # a model turn ends at the turn marker
        end_of_turn = [build_formatter(config.environment.formatter, tokenizer).end_of_turn]
    else:
        end_of_turn = template_end_of_turn(tokenizer)
    stop = [*config.generators.stop, *(s for s in end_of_turn if s not in config.generators.stop)]
    generators = config.generators.model_copy(update={"stop": stop})
    config = config.model_copy(update={"generators": generators})
    torch.manual_seed(seed)
    context = client_context(config.cluster, GENERATOR)
    incarnation = new_incarnation()  # this process: the buffer hears no other under its name
    replica: GeneratorReplica | None = None

    def stop_replica(_signum: int) -> None:
        if replica is not None:  # else it starts stopping (signals() is already true)
            replica.stopping = True

    with StopSignals(ROLE_SIGNALS, on_stop=stop_replica) as signals:
        # the vLLM backend writes the model to this replica's directory and loads it from there
        backend = build_backend(config, model, tokenizer, work_dir, seed)
        try:
            buffer = RequestClient(context, buffer_endpoint)
            joined, _ = buffer.request(Join(name, pool, incarnation))
            if not isinstance(joined, Joined):
                raise RuntimeError(f"the buffer at {buffer_endpoint} answered Join with {joined!r}")
            log.info("%s joined run %r at version %d", name, joined.run_name, joined.policy_version)
            heartbeats = HeartbeatThread(
                context,
                buffer_endpoint,
                name,
                config.buffer.heartbeat_interval_s,
                reply_timeout_s=config.buffer.heartbeat_timeout_s,
                incarnation=incarnation,
            ).start()
            collective = replica_source(config, name, learner_host) if learner_host else None
            replica = GeneratorReplica(
                config, name, backend, context, pool, buffer, weights_endpoint(joined), incarnation,
                run_dir=run_dir, collective=collective,
            )  # fmt: skip
            # 1 on a restarted replica (a new id each time): summed over ids, the restart count
            replica.stats["restarts"] = int(restarts > 0)
            replica.stopping = signals()
            try:
                replica.run_loop()
            finally:
                heartbeats.stop()
                replica.close()
        finally:
            backend.close()
            context.destroy(linger=0)
