"""The learner loop calls every part every step, in the algorithm's order, and each part
decides for itself whether to act (publish, checkpoint) - on rank 0 and on the others."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import torch

from asyncrl.config import load_config
from asyncrl.generation import lora
from asyncrl.learner import trainer
from asyncrl.learner.batch_source import Fetched
from asyncrl.learner.checkpointer import Checkpointer, NoCompleter
from asyncrl.learner.publisher import Drain, Publisher


class FakeLearner:
    """The policy as the loop and its parts see it: a version, and calls recorded."""

    def __init__(self, calls: list, *overrides: str, version: int = 0):
        self.calls = calls
        self.config = load_config(None, ["model.tiny={}", *overrides])
        self.version = version
        self.drained: list[int] = []
        self.publishes_adapters = self.config.model.publishes_adapters

    def proximal_logprobs(self, batch) -> dict:
        self.calls.append(("proximal", batch))
        return {"proximal": batch}

    def train_step(self, batch, proximal: dict) -> dict[str, float]:
        assert proximal == {"proximal": batch}  # the loop hands over its own pre-pass
        self.calls.append(("train", batch))
        self.version += 1
        return {"loss_policy": 0.5}

    def published_tensors(self):
        for name in ("a.lora_A.weight", "a.lora_B.weight"):  # a collective: every rank drains
            yield name, torch.full((2, 2), float(self.version))
        self.drained.append(self.version)

    def save_checkpoint(self, path: Path) -> bool:
        self.calls.append(("save", path.name))
        return True


class Recorder:
    """A part whose every method call is recorded (with its arguments) in ``calls``."""

    def __init__(self, name: str, calls: list, returns=None):
        self.name, self.calls, self.returns = name, calls, returns or {}

    def __getattr__(self, method: str):
        def record(*args):
            self.calls.append((f"{self.name}.{method}", *args))
            return self.returns.get(method)

        return record


def loop_parts(calls: list, stop_at: int | None = None) -> trainer.Parts:
    def next_batch(version: int) -> Fetched | None:
        calls.append(("batches.next", version))
        return None if version == stop_at else Fetched(f"batch {version}", {}, 0.0)

    return trainer.Parts(
        batches=SimpleNamespace(next=next_batch),
        publisher=Recorder("publisher", calls, {"after_step": 0.25}),
        evaluator=Recorder("evaluator", calls),
        step_log=Recorder("step_log", calls),
        checkpointer=Recorder("checkpointer", calls),
    )


def test_each_step_gets_a_batch_then_proximal_update_publish_eval_log_checkpoint():
    calls: list = []
    learner = FakeLearner(calls, version=3)  # resumed at version 3
    trainer._train_loop(learner, loop_parts(calls), total_steps=5)

    assert learner.version == 5
    names = [call[0] for call in calls]
    step = ["batches.next", "proximal", "train", "publisher.after_step",
            "evaluator.after_step", "step_log.log", "checkpointer.after_step"]  # fmt: skip
    assert names == step + step
    assert calls[0] == ("batches.next", 3) and calls[7] == ("batches.next", 4)
    assert ("evaluator.after_step", 4) in calls  # the version just made (and published)
    fetched, version, metrics, _, stall_s = calls[5][1:]
    assert (fetched.batch, version, metrics, stall_s) == ("batch 3", 3, {"loss_policy": 0.5}, 0.25)


def test_a_stop_agreed_on_every_rank_ends_the_loop_before_the_step_trains():
    calls: list = []
    learner = FakeLearner(calls)
    trainer._train_loop(learner, loop_parts(calls, stop_at=2), total_steps=5)
    assert learner.version == 2
    assert calls[-1] == ("batches.next", 2)


def test_the_loop_body_reads_like_the_algorithm_with_no_rank_test():
    source = inspect.getsource(trainer._train_loop)
    body = source.split('"""')[-1].strip().splitlines()[1:]  # after the `for` line
    assert len(body) <= 15, "\n".join(body)
    assert not any(word in line for line in body for word in ("rank", "main")), source


def test_every_rank_publishes_the_versions_due_and_only_rank_0_keeps_the_tensors():
    learner = FakeLearner([], "learner.sync_interval=2", "eval.every_steps=2")
    published: list[int] = []

    class Sink(Drain):
        def publish(self, tensors, version: int) -> None:
            super().publish(tensors, version)
            published.append(version)

    for sink in (Drain(), Sink()):  # another rank's, rank 0's
        learner.version, learner.drained = 0, []
        publisher = Publisher(learner, learner.config, sink)
        publisher.publish()
        for version in (1, 2, 3):
            learner.version = version
            publisher.after_step()
        publisher.finish()  # the final eval (eval.at_end) needs version 3 published
        assert learner.drained == [0, 2, 3]
    assert published == [0, 2, 3]


def test_adapters_are_announced_before_they_are_published_and_not_published_unannounced():
    learner = FakeLearner([], "model.lora.rank=4")
    events: list[tuple] = []
    answers = iter([True, False])  # the buffer took v0's digest; a stop cut v1's short

    def announce(version: int, digest: str) -> bool:
        events.append(("announce", version, digest))
        return next(answers)

    class Sink(Drain):
        def publish(self, tensors, version: int) -> None:
            events.append(("publish", version, [name for name, _ in tensors]))

    publisher = Publisher(learner, learner.config, Sink(), announce=announce)
    publisher.publish()
    learner.version = 1
    publisher.publish()
    digest = lora.adapter_digest(
        [(n, torch.zeros(2, 2)) for n in ("a.lora_A.weight", "a.lora_B.weight")]
    )
    assert events == [
        ("announce", 0, digest),
        ("publish", 0, ["a.lora_A.weight", "a.lora_B.weight"]),
        ("announce", 1, events[2][2]),
    ]
    assert events[2][2] != digest and publisher.published == 0  # v1 never went out


def test_no_final_publish_without_a_final_eval():
    learner = FakeLearner([], "learner.sync_interval=2", "eval.every_steps=2", "eval.at_end=false")
    publisher = Publisher(learner, learner.config, Drain())
    learner.version = 3
    publisher.finish()
    assert learner.drained == []


def test_every_rank_checkpoints_when_due_and_on_a_stop_unless_already_saved(tmp_path):
    calls: list = []
    learner = FakeLearner(calls, "learner.checkpoint_every=2", version=1)
    checkpointer = Checkpointer(learner, tmp_path, NoCompleter())  # a rank other than 0
    for version in (2, 3):
        learner.version = version
        checkpointer.after_step()
    checkpointer.on_stop()  # version 3: not yet saved
    learner.version = 4
    checkpointer.after_step()
    checkpointer.on_stop()  # version 4 was just saved
    assert calls == [("save", "step-000002"), ("save", "step-000003"), ("save", "step-000004")]
