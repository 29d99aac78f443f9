"""The learner: pull a batch, take a policy-gradient step, publish, log. Repeat.

::

    buffer ──Trajectories──▶ learner ──Weights(V)──▶ generators
           ◀─BatchRequest(V)─   │
                                └──▶ metrics.jsonl, aim

The policy's version ``V`` counts optimizer updates. The batch handed over at
version ``V`` holds no sample older than ``V - max_staleness`` (the buffer's
``take_batch`` guarantees it; this loop reports the staleness it actually
got). Weights are published every ``sync_interval`` versions.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import zmq

from asyncrl.config import AlgorithmConfig, Config
from asyncrl.learner.algorithms import ADVANTAGES, masked_mean, policy_loss, token_logprobs
from asyncrl.learner.batch import TrainBatch, collate
from asyncrl.messages import BatchRequest, Trajectories
from asyncrl.models import build_policy
from asyncrl.tracking import Tracker
from asyncrl.transport import RequestClient, tcp
from asyncrl.weights import WeightPublisher

log = logging.getLogger("asyncrl.learner")


class BatchSource:
    """Asks the buffer for the next batch and waits, however long generation takes."""

    def __init__(self, context: zmq.Context, endpoint: str, pad_id: int):
        self.client = RequestClient(context, endpoint, timeout_s=3600.0)
        self.pad_id = pad_id

    def next_batch(self, policy_version: int) -> tuple[TrainBatch, dict[str, float]]:
        reply, arrays = self.client.request(BatchRequest(policy_version))
        if not isinstance(reply, Trajectories):
            raise RuntimeError(f"buffer answered a batch request with {reply!r}")
        return collate(reply.samples, arrays, self.pad_id), reply.stats


def train_step(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    algorithm: AlgorithmConfig,
    grad_clip: float,
    temperature: float,
) -> dict[str, float]:
    """One optimizer update on ``batch``: GRPO advantages, clipped loss, TIS correction."""
    advantages = ADVANTAGES[algorithm.advantage](
        batch.rewards, batch.group_ids, algorithm.normalize_std
    )
    policy.train()
    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logprobs = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], temperature)  # [B, L-1]
    # One update per batch: the proximal policy is the current one, detached.
    proximal = logprobs.detach()
    loss, stats = policy_loss(
        logprobs,
        proximal,
        batch.behavior_logprobs,
        advantages,
        batch.loss_mask,
        clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high,
        correction=algorithm.correction,
        correction_cap=algorithm.correction_cap,
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
    optimizer.step()
    policy.eval()
    with torch.no_grad():
        log_p = logits[:, :-1].float().log_softmax(-1)  # [B, L-1, V]
        entropy = -(log_p.exp() * log_p).sum(-1)  # [B, L-1]
    return {
        "loss_policy": loss.item(),
        "learner_grad_norm": grad_norm.item(),
        "learner_entropy": masked_mean(entropy, batch.loss_mask).item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
        **{
            f"learner_{k}" if not k.startswith("importance") else k: v.item()
            for k, v in stats.items()
        },
        "_proximal": proximal,  # used for logprob_mismatch below, not logged
    }


def logprob_mismatch(proximal: torch.Tensor, batch: TrainBatch, policy_version: int) -> float:
    """Mean |learner - generator| log-prob over tokens made with the learner's current weights."""
    current = (batch.token_versions == policy_version) & batch.loss_mask.bool()
    if not current.any():
        return float("nan")
    return (proximal - batch.behavior_logprobs).abs()[current].mean().item()


def run(config: Config, run_dir: Path) -> None:
    torch.set_num_threads(config.learner.num_threads)
    torch.manual_seed(config.run.seed)
    policy, tokenizer = build_policy(config.model, config.run.seed)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay
    )
    context = zmq.Context()
    publisher = WeightPublisher(tcp(config.cluster.host, config.cluster.weights_port))
    publisher.publish(policy.state_dict(), version=0)
    batches = BatchSource(
        context, tcp(config.cluster.host, config.cluster.buffer_port), tokenizer.pad_token_id
    )
    tracker = Tracker(run_dir, config.run.name, config.model_dump(mode="json"), config.tracking.aim)

    version, samples_total, wait_total, started = 0, 0, 0.0, time.perf_counter()
    try:
        for step in range(config.run.total_steps):
            waited = time.perf_counter()
            batch, buffer_stats = batches.next_batch(version)
            wait_s = time.perf_counter() - waited
            wait_total += wait_s

            metrics = train_step(
                policy,
                optimizer,
                batch,
                config.algorithm,
                config.learner.grad_clip,
                config.generators.temperature,
            )
            mismatch = logprob_mismatch(metrics.pop("_proximal"), batch, version)
            staleness = (version - batch.versions).float()
            version += 1
            stall = 0.0
            if version % config.learner.sync_interval == 0:
                stall = publisher.publish(policy.state_dict(), version)

            samples_total += batch.num_samples
            elapsed = time.perf_counter() - started
            tracker.log(
                step,
                {
                    "version": version,
                    "reward_mean": batch.rewards.mean().item(),
                    "staleness_mean": staleness.mean().item(),
                    "staleness_max": staleness.max().item(),
                    "samples_total": samples_total,
                    "samples_per_s": samples_total / elapsed,
                    "response_len_mean": batch.response_lengths.float().mean().item(),
                    "logprob_mismatch": mismatch,
                    "learner_wait_s": wait_s,
                    "learner_wait_frac": wait_total / elapsed,
                    "time_publish_stall_s": stall,
                    "time_s": elapsed,
                    **metrics,
                    **buffer_stats,
                },
            )
        final = run_dir / "final"
        policy.save_pretrained(final)
        tokenizer.save_pretrained(final)
        log.info("saved the final policy to %s", final)
    finally:
        tracker.close()
        publisher.close()
        context.destroy(linger=0)
