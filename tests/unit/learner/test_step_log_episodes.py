"""A batch's episode figures go from the buffer's reply to the step's line of
``metrics.jsonl`` (the learner merges the batch's ``stats`` whole), and on to the
console's step line."""

from __future__ import annotations

import json
from contextlib import ExitStack

from asyncrl.config import load_config
from asyncrl.core.messages import BatchRequest, EpisodeCounts, WorkRequest, decode, encode
from asyncrl.learner.batch import collate
from asyncrl.learner.batch_source import Fetched
from asyncrl.learner.step_log import StepLog
from asyncrl.run.console import step_line
from tests.helpers.buffer_samples import episodes_of
from tests.helpers.buffer_service import LEARNER, Recorded


class KeepsArrays(Recorded):
    """A recorded buffer that also keeps the arrays of its latest reply."""

    async def _reply(self, identity: bytes, body, arrays=None) -> bool:
        self.arrays = arrays
        return await super()._reply(identity, body, arrays)


def received_batch() -> tuple:
    """A batch of episodes as the learner receives it: its body and its array frames."""
    buffer = KeepsArrays()
    try:
        buffer.handle(b"g", WorkRequest("gen-g", 4))
        first, second = buffer.last(b"g").items
        buffer.handle(b"g", *episodes_of(first, "gen-g", EpisodeCounts(1, 1, 0)))
        buffer.handle(b"g", *episodes_of(second, "gen-g", EpisodeCounts(3, 2, 2)))
        buffer.handle(LEARNER, BatchRequest(policy_version=0))
        body, arrays = buffer.last(LEARNER), buffer.arrays
    finally:
        buffer.close()
    return decode([bytes(frame) for frame in encode(body, arrays)])


def test_a_batch_s_episode_figures_reach_the_step_s_line(tmp_path):
    reply, arrays = received_batch()
    config = load_config(None, ["model.tiny={}", "tracking.aim=false"])
    with ExitStack() as cleanup:
        log = StepLog(config, tmp_path, None, dict, cleanup)
        batch = collate(reply.samples, arrays, pad_id=0)
        log.log(Fetched(batch, reply.stats, 0.0), 0, {"loss": 0.5}, 1.0, 0.0)
    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["episode_turns_mean"] == 2.0
    assert record["episode_tool_calls_mean"] == 1.5
    assert record["episode_tool_success_frac"] == 0.5
    assert record["episode_tool_error_frac"] == 4 / 6  # errors over calls
    assert record["episode_truncated_frac"] == 0.0
    assert step_line(record, 10).endswith("wait 0%  turns 2.0  tools 0.50")


def test_samples_spanning_versions_are_those_with_model_tokens_of_two_versions():
    import torch

    from asyncrl.core.trajectory import ENV_VERSION
    from asyncrl.learner.step_log import spanning_versions_frac

    e = ENV_VERSION
    versions = torch.tensor(
        [
            [3, 3, e, e, 4, 4],  # turns before and after an update, a tool reply between
            [3, 3, 3, e, e, e],  # one version, then padding
            [e, e, e, e, e, e],  # no model token
            [5, e, 5, e, 5, e],  # one version around environment tokens
        ]
    )
    assert spanning_versions_frac(versions) == 0.25
    assert spanning_versions_frac(versions[1:]) == 0.0
