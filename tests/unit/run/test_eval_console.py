"""The latest held-out eval reward in the launcher's console and in `asyncrl status`."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.config import load_config, save_config
from asyncrl.run.console import LiveConsole, PlainConsole
from asyncrl.run.status import show
from tests.helpers.console import append, record


def test_the_plain_line_ends_with_the_latest_eval_once_there_is_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    out = io.StringIO()
    console = PlainConsole(path, 20, out=out)
    append(path, record(0), record(1, eval_reward=0.4123), record(2))
    console.update([])
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("wait 25%")  # no round reported yet: the line as always
    assert lines[1].endswith("wait 25%  eval 0.412 @v10")
    assert lines[2].endswith("eval 0.412 @v10")  # the latest, until the next round


def test_the_live_panel_shows_the_latest_eval(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "algorithm.prompts_per_step=8"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    live = LiveConsole(path, config, tmp_path)
    live.live.stop()
    append(path, record(0, eval_reward=0.25), record(1))
    live.update([])
    out = io.StringIO()
    Console(file=out, width=120).print(live.render())
    assert "eval reward 0.250 @v10" in " ".join(out.getvalue().split())


def test_status_shows_the_latest_eval_round(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "eval.every_steps=5"])
    save_config(config, tmp_path / "config.yaml")
    append(tmp_path / "metrics.jsonl", record(0, eval_reward=0.125), record(1))
    out = io.StringIO()
    assert show(tmp_path, Console(file=out, width=200)) == 0
    assert (
        "latest eval: round 2 of version 10, reward 0.125 over 64 held-out samples "
        "(logged at step 1)"
    ) in out.getvalue()
