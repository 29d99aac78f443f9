"""A single-turn sample is a one-turn episode of the replica's driver
(asyncrl.generators.episodes): the backend's at once, its response scored by the
reward workers with its item's ``extra_info``, every turn ended in a chunk in one batch."""

from __future__ import annotations

from concurrent.futures import Future

from asyncrl.core.messages import WorkItem
from asyncrl.generation.rewards import Score
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators.episodes import Episodes
from tests.helpers.generators import ScriptedBackend


class RecordingScorer:
    """Answers each batch with futures the test resolves; records the batches."""

    def __init__(self):
        self.batches: list[list[tuple]] = []
        self.futures: list[Future] = []

    def submit_many(self, samples):
        self.batches.append(list(samples))
        futures = [Future() for _ in self.batches[-1]]
        self.futures += futures
        return futures


def test_one_turn_episodes_are_scored_in_one_batch_and_hold_no_slot():
    tokenizer = build_tokenizer()
    scorer = RecordingScorer()
    episodes = Episodes(None, tokenizer, max_tokens_per_turn=16, scorer=scorer)
    item = WorkItem(7, 3, [1, 4, 5, 6, 13], "234", "synthetic/digits", {"split": "a"})
    rollouts = [episodes.start(item, index, now=0.0) for index in range(3)]
    assert not any(r.finished for r in rollouts)  # the backend's at once: no environment
    assert episodes.waiting == 0 and episodes.unscored == 0

    ScriptedBackend(tokenizer, turn_length=3).generate_chunk(rollouts, 8)
    episodes.end_turns(rollouts)
    text = tokenizer.decode(rollouts[0].response_ids, skip_special_tokens=True)
    assert scorer.batches == [[("synthetic/digits", text, "234", {"split": "a"})] * 3]
    assert episodes.unscored == 3 and episodes.waiting == 0  # being scored holds no slot

    scorer.futures[2].set_result(Score(0.0, "error:timeout", "slow"))
    scorer.futures[0].set_result(Score(1.0))
    assert episodes.collect() == (
        [],
        [(rollouts[0], Score(1.0)), (rollouts[2], scorer.futures[2].result())],
    )
    scorer.futures[1].set_result(Score(0.5))
    episodes.wait_for_scores(1.0)
    assert episodes.collect() == ([], [(rollouts[1], Score(0.5))])
    assert not episodes.running and episodes.unscored == 0
    assert not episodes.stats  # the env_ counters are the environments' alone
    assert all(r.episode is None and r.finish_reason == "stop" for r in rollouts)
    episodes.close()
