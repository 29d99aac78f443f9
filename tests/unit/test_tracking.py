"""metrics.jsonl and aim receive the same values, under flat and namespaced names."""

from __future__ import annotations

import json

import pytest

from asyncrl.tracking import NullAim, Tracker, aim_name


def test_aim_names_are_namespaced_by_their_first_word_only_for_known_namespaces():
    assert aim_name("buffer_dropped_stale") == "buffer/dropped_stale"
    assert aim_name("reward_mean") == "reward/mean"
    assert aim_name("eval_reward_mean") == "eval/reward_mean"
    assert aim_name("generators_busy_fraction") == "generators/busy_fraction"
    assert aim_name("samples_total") == "samples_total"
    assert aim_name("version") == "version"


def test_tracker_writes_one_json_line_per_step(tmp_path):
    tracker = Tracker(tmp_path, "test", {"lr": 1e-3}, use_aim=False)
    assert isinstance(tracker.aim, NullAim)
    tracker.log(0, {"reward_mean": 0.25, "version": 1})
    tracker.log(1, {"reward_mean": 0.5, "version": 2})
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 0, "reward_mean": 0.25, "version": 1},
        {"step": 1, "reward_mean": 0.5, "version": 2},
    ]


def test_a_value_with_nothing_to_measure_is_null_in_strict_json_and_not_sent_to_aim(tmp_path):
    tracked = []

    class RecordingAim(NullAim):
        def track(self, value, name, step):
            tracked.append((name, step, value))

    tracker = Tracker(tmp_path, "test", {}, use_aim=False)
    tracker.aim = RecordingAim()
    tracker.log(3, {"logprob_mismatch": float("nan"), "reward_mean": 0.5, "version": 4})
    tracker.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    line = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON line"))
    assert line == {"step": 3, "logprob_mismatch": None, "reward_mean": 0.5, "version": 4}
    assert tracked == [("reward/mean", 3, 0.5), ("version", 3, 4)]


def test_aim_run_in_the_run_directory_holds_every_logged_value(tmp_path):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    tracker = Tracker(tmp_path, "test", {"algorithm": {"group_size": 8}}, use_aim=True)
    for step, reward in enumerate([0.1, 0.2, 0.7]):
        tracker.log(step, {"reward_mean": reward, "buffer_held": float(step)})
    tracker.close()

    repo = Repo.from_path(str(tmp_path))
    (run_hash,) = list(repo.list_all_runs())
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # the SDK reads indexed runs only
    run = repo.get_run(run_hash)
    metrics = {metric.name: metric for metric in run.metrics()}
    assert {"reward/mean", "buffer/held"} <= set(metrics)
    _, values = metrics["reward/mean"].values.sparse_numpy()
    assert sorted(values.round(6).tolist()) == [0.1, 0.2, 0.7]
    assert run["hparams"]["algorithm"]["group_size"] == 8


def test_sampled_generations_reach_aim_as_text_per_step(tmp_path):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    tracker.log_generations(3, [{"prompt": "123=", "response": "234", "reward": 1.0}])
    tracker.log_generations(4, [{"prompt": "555=", "response": "6", "reward": 0.3}])
    tracker.close()

    repo = Repo.from_path(str(tmp_path))
    (run_hash,) = list(repo.list_all_runs())
    RepoIndexManager.get_index_manager(repo).index(run_hash)
    sequence = repo.get_run(run_hash).get_text_sequence("generations", Context({"sample": 0}))
    steps, (texts, *_) = sequence.data.items_list()
    assert steps == [3, 4]
    assert texts[0].data == "prompt: 123=\nresponse: 234\nreward: 1.0"
    assert "response: 6" in texts[1].data


def test_generations_are_not_decoded_or_written_when_aim_is_off(tmp_path):
    tracker = Tracker(tmp_path, "test", {}, use_aim=False)
    tracker.log_generations(0, [{"prompt": "1=", "response": "2"}])
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
