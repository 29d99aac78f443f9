"""The broadcast sends from the learner's shared-memory slot, which any process of the run's
user may write: a replica checks what it receives before the version counts, refuses NaN
(and an offer not laid out as its engine is), and does not ask for that version again."""

from __future__ import annotations

import pytest
import torch

from asyncrl.weights.shm.segment import SHM_DIR
from tests.helpers.collective import (
    BUCKET_BYTES,
    LAYERS,
    WIDTH,
    assert_holds,
    command,
    running_replica,
    version_tensors,
)
from tests.helpers.weights import NAN, tamper

pytestmark = pytest.mark.slow  # a spawned replica process


@pytest.mark.timeout(180)
@pytest.mark.parametrize("homing", [False, True], ids=["into_staging", "into_the_model"])
def test_nan_written_into_the_slot_is_refused_by_the_replica_and_not_sent_again(learner, homing):
    sink, sender = learner
    with running_replica(
        sender.address, BUCKET_BYTES, WIDTH, layers=LAYERS, homing=homing
    ) as replica:
        sink.publish(version_tensors(1, WIDTH, LAYERS).items(), 1)
        assert command(replica, "sync", 30.0) == ("ok", 1, 1)
        sink.publish(version_tensors(2, WIDTH, LAYERS).items(), 2)
        tamper(SHM_DIR / sink.writer.name, 2, "1.weight", NAN)

        reply = command(replica, "sync", 30.0)
        assert reply[:2] == ("error", "WeightsRefused"), reply
        _, _, message, partial, _, _, held = reply
        assert "collective v2: refused: tensor '1.weight' holds NaN" in message
        # staging: the engine never saw v2; the model's own tensors: they hold it now, so
        # the chain must reload a whole version (partial) before a token is generated
        assert held == 1 and partial is homing
        if not homing:
            assert_holds(replica, 1)
        assert sender.stats()["weights_collective_members"] == 1  # the group is sound

        finished = sender.stats()["weights_collective_transfers_finished_total"]
        assert command(replica, "sync", 30.0) == ("ok", None, 1)  # v2 is not sent again
        assert sender.stats()["weights_collective_transfers_finished_total"] == finished

        sink.publish(version_tensors(3, WIDTH, LAYERS).items(), 3)  # a good one: taken
        assert command(replica, "sync", 30.0) == ("ok", 3, 3)
        assert_holds(replica, 3)


@pytest.mark.timeout(180)
def test_an_offer_not_laid_out_as_the_engine_is_refused_before_a_byte_is_received(learner):
    sink, sender = learner
    with running_replica(sender.address, BUCKET_BYTES, WIDTH, layers=LAYERS) as replica:
        sink.publish(version_tensors(1, WIDTH, LAYERS).items(), 1)
        assert command(replica, "sync", 30.0) == ("ok", 1, 1)
        wrong = version_tensors(2, WIDTH, LAYERS)
        wrong["scale"] = wrong["scale"].to(torch.float32)  # the model's is bfloat16
        sink.publish(wrong.items(), 2)

        reply = command(replica, "sync", 30.0)
        assert reply[:2] == ("error", "WeightsRefused"), reply
        assert "tensor 'scale' is float32, expected bfloat16" in reply[2]
        assert reply[3] is False and reply[-1] == 1  # nothing received
        assert_holds(replica, 1)
        assert command(replica, "sync", 30.0) == ("ok", None, 1)  # v2 is not asked for again
