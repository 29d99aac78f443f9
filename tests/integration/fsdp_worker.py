"""One learner rank for the FSDP2 tests, started by torchrun (or directly for one rank).

``python -m tests.integration.fsdp_worker OUT_DIR STEPS [key=value ...] [--save-at N]
[--resume CKPT] [--export] [--no-publish]`` (from the repository root)
trains on deterministic synthetic batches (the same on every rank and in every
run) and writes rank 0's full parameters to ``OUT_DIR/params.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import zmq

from asyncrl.config import load_config
from asyncrl.core.transport import free_port, tcp
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import checkpoint, distributed
from asyncrl.learner.policy import Learner
from asyncrl.learner.publisher import Drain, Publisher
from asyncrl.weights import WeightClient, WeightPublisher
from tests.helpers.learner import synthetic_batch


def published_and_fetched(learner: Learner, is_main: bool) -> dict | None:
    """Publish the sharded policy as the trainer does (:class:`Publisher`, streamed from
    every rank), then rebuild it as a generator does; rank 0 returns the rebuilt state dict."""
    if not is_main:
        Publisher(learner, learner.config, Drain()).publish()
        return None
    publisher = WeightPublisher(tcp("127.0.0.1", free_port("127.0.0.1")), chunk_bytes=4096)
    context = zmq.Context()
    try:
        Publisher(learner, learner.config, publisher).publish()
        client = WeightClient(context, publisher.endpoint)
        version, _, state_dict = client.fetch_newer(-1)
        client.close()
        assert version == learner.version
        return {name: tensor.clone() for name, tensor in state_dict.items()}
    finally:
        publisher.close()
        context.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--export", action="store_true", help="save_pretrained to OUT/final")
    parser.add_argument(
        "--no-publish", action="store_true", help="skip the 4 KiB-chunk publish (large models)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [
        "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64",
        "algorithm.group_size=4",
        "algorithm.prompts_per_step=4",
        "learner.max_tokens_per_microbatch=48",
        "learner.lr=0.01",
        "learner.lr_schedule=cosine",
        "learner.warmup_steps=1",
        f"run.total_steps={max(args.steps, 1)}",
    ]
    config = load_config(None, ["model.tiny.num_layers=2", *base, *args.overrides])
    torch.set_num_threads(1)
    ranks = distributed.init("cpu")
    torch.manual_seed(config.run.seed)
    learner = Learner(config, ranks)
    if args.resume:
        learner.load_checkpoint(args.resume)
    vocab = len(build_tokenizer())
    metrics = {}
    while learner.version < args.steps:
        batch = synthetic_batch(learner.version, vocab)
        metrics = learner.train_step(batch, learner.proximal_logprobs(batch))
        if learner.version == args.save_at:
            learner.save_checkpoint(args.out / "checkpoint")
            if ranks.is_main:
                checkpoint.mark_complete(args.out / "checkpoint")
    params = dict(learner.full_tensors())
    if args.export:
        learner.save_pretrained(args.out / "final")
    rebuilt = None if args.no_publish else published_and_fetched(learner, ranks.is_main)
    if ranks.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"params": params, "metrics": metrics, "rebuilt": rebuilt}, args.out / "params.pt"
        )
    distributed.barrier(ranks)  # ends as the learner does (asyncrl.run.roles)
    distributed.shutdown()
    distributed.exit_without_finalizing()


if __name__ == "__main__":
    main()
