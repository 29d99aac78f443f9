"""`asyncrl status` on a run directory, without a live buffer."""

from __future__ import annotations

import io
import json

from rich.console import Console

from asyncrl.config import load_config, save_config
from asyncrl.status import read_metrics, show


def record(step: int) -> dict:
    return {
        "step": step, "version": step + 1, "reward_mean": 0.5, "staleness_mean": 1.0,
        "staleness_max": 1, "samples_per_s": 100.0,
    }  # fmt: skip


def test_a_line_the_learner_is_still_writing_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record(0)) + "\n" + '{"step": 1, "ver')
    assert read_metrics(tmp_path) == [record(0)]


def test_status_of_a_stopped_run_shows_its_steps_checkpoint_and_pools(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "run.total_steps=20"])
    save_config(config, tmp_path / "config.yaml")  # buffer_port 0: nothing to ask
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "buffer.log").write_text("")
    lines = "".join(json.dumps(record(step)) + "\n" for step in range(7))
    (tmp_path / "metrics.jsonl").write_text(lines)
    out = io.StringIO()
    assert show(tmp_path, Console(file=out, width=120)) == 0
    text = out.getvalue()
    assert "[not running]" in text and "step 7/20, version 7" in text
    assert "latest complete checkpoint: none" in text
    assert "buffer" in text and "default" in text  # a role's log, the default pool
    assert show(tmp_path / "nothing", Console(file=io.StringIO())) == 2
