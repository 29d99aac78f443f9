"""Turns and tool use in the launcher's console, for steps whose batch held episodes."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.config import load_config
from asyncrl.run.console import LiveConsole, PlainConsole, step_line
from tests.helpers.console import RECORD, append, record

EPISODES = {
    "episode_turns_mean": 2.125, "episode_tool_calls_mean": 1.5,
    "episode_tool_success_frac": 0.4321, "episode_tool_error_frac": 0.25,
    "episode_truncated_frac": 0.0,
}  # fmt: skip


def test_the_plain_line_shows_turns_and_tool_success_after_wait():
    assert step_line(RECORD | EPISODES, 600) == (
        "step   10/600  v10    reward 0.500  staleness 0.75/1  samples/s 123.4  wait 25%"
        "  turns 2.1  tools 0.43"
    )


def test_a_single_turn_line_is_unchanged_and_the_eval_part_still_ends_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    out = io.StringIO()
    console = PlainConsole(path, 20, out=out)
    append(path, record(0), record(1, eval_reward=0.5) | EPISODES)
    console.update([])
    single, episodes = out.getvalue().splitlines()
    assert single.endswith("wait 25%")
    assert episodes.endswith("wait 25%  turns 2.1  tools 0.43  eval 0.500 @v10")


def test_odd_episode_figures_show_as_missing_or_nan():
    odd = RECORD | {"episode_turns_mean": None, "episode_tool_success_frac": float("nan")}
    assert step_line(odd, 600).endswith("wait 25%  turns —  tools nan")


def test_the_live_panel_shows_turns_and_tool_use_only_with_episodes(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "algorithm.prompts_per_step=8"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    live = LiveConsole(path, config, tmp_path)
    live.live.stop()  # render by hand below, not on the terminal

    def shown() -> str:
        live.update([])
        out = io.StringIO()
        Console(file=out, width=120).print(live.render())
        return " ".join(out.getvalue().split())

    append(path, record(0))
    assert "turns" not in shown()
    append(path, record(1) | EPISODES)
    assert "turns 2.1 tool success 43% tool errors 25%" in shown()
