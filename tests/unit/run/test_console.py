"""The launcher's console: following metrics.jsonl, the plain line, the live panel."""

from __future__ import annotations

import io
import json

from rich.console import Console

from asyncrl.config import load_config
from asyncrl.run.console import LiveConsole, MetricsFollower, PlainConsole, ReplicaHealth, step_line
from tests.helpers.console import RECORD


def test_follower_starts_at_the_end_and_reads_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0}) + "\n")  # an earlier run's step (a resume)
    follower = MetricsFollower(path)
    assert follower.poll() == []
    with path.open("a") as file:
        file.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')  # mid-write
    assert follower.poll() == [{"step": 1}]
    with path.open("a") as file:
        file.write('ard_mean": 0.5}\n')
    assert follower.poll() == [{"step": 2, "reward_mean": 0.5}]


def test_plain_line_format():
    assert step_line(RECORD, 600) == (
        "step   10/600  v10    reward 0.500  staleness 0.75/1  samples/s 123.4  wait 25%"
    )


def test_live_panel_shows_figures_buffer_fill_and_pool_health(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "algorithm.prompts_per_step=8"])
    (tmp_path / "metrics.jsonl").write_text("")
    live = LiveConsole(tmp_path / "metrics.jsonl", config, tmp_path)
    live.live.stop()  # render by hand below, not on the terminal
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(RECORD) + "\n")
    health = [
        ReplicaHealth("default", "generator-0", "alive", 0),
        ReplicaHealth("default", "generator-1", "restarting", 2),
    ]
    live.update(health)
    out = io.StringIO()
    Console(file=out, width=120).print(live.render())
    text = out.getvalue()
    assert "0.500" in text and "0.75 mean, 1 max" in text
    # 4 batches of 8 x 8 samples: 128 held is half of the default bound
    assert "128/256 samples (50%)" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("default"))
    assert row.split() == ["default", "2", "1", "1", "2"]


# --------------------------------------------------------------------------
# figures that are null (a NaN batch), not finite, strings or missing never raise

NAN, INF = float("nan"), float("inf")
ODD = {
    **RECORD, "reward_mean": None, "staleness_mean": NAN, "staleness_max": "1",
    "samples_per_s": INF, "learner_wait_frac": -INF, "buffer_held": None,
}  # fmt: skip


def test_the_plain_line_shows_odd_figures_as_missing_or_nan():
    assert step_line(ODD, 600) == (
        "step   10/600  v10    reward —  staleness nan/—  samples/s inf  wait -inf"
    )
    assert (
        step_line({}, 600) == "step    —/600  v—     reward —  staleness —/—  samples/s —  wait —"
    )
    odd_eval = {"eval_reward_mean": NAN, "eval_policy_version": None}
    assert step_line(RECORD, 600, odd_eval).endswith("wait 25%  eval nan @v—")


def test_the_plain_console_follows_odd_records_and_skips_lines_that_are_not_objects(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    out = io.StringIO()
    console = PlainConsole(path, 600, out=out)
    with path.open("ab") as file:  # NaN and Infinity as Python's json writes them
        file.write(json.dumps(ODD).encode() + b"\n[1, 2]\n\xff\xfe\n" + json.dumps({}).encode())
        file.write(b"\n" + json.dumps({**RECORD, "step": 10, "eval_reward_mean": None}).encode())
        file.write(b"\n")
    console.update([])
    assert out.getvalue().splitlines() == [
        "step   10/600  v10    reward —  staleness nan/—  samples/s inf  wait -inf",
        "step    —/600  v—     reward —  staleness —/—  samples/s —  wait —",
        "step   11/600  v10    reward 0.500  staleness 0.75/1  samples/s 123.4  wait 25%",
    ]


def render(live: LiveConsole) -> str:
    """The panel as text, runs of spaces made one (column widths vary)."""
    out = io.StringIO()
    Console(file=out, width=160).print(live.render())
    return " ".join(out.getvalue().split())


def test_the_live_panel_shows_odd_figures_and_keeps_the_last_good_step(tmp_path):
    config = load_config(None, ["model.tiny.hidden_size=64", "algorithm.prompts_per_step=8"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    live = LiveConsole(path, config, tmp_path)
    live.live.stop()  # render by hand below, not on the terminal
    live.update([])
    odd_eval = {**ODD, "eval_reward_mean": NAN, "eval_policy_version": "ten"}
    with path.open("a") as file:
        file.write(json.dumps(odd_eval) + "\n")
    live.update([])
    text = render(live)
    assert "version 10 reward — staleness nan mean, — max" in text
    assert "samples/s inf learner wait -inf buffer —/256 samples (—)" in text
    assert "eval reward nan @v—" in text
    assert live.progress.tasks[0].completed == 10
    with path.open("a") as file:
        file.write(json.dumps({"step": None, "buffer_held": NAN}) + "\n")
    live.update([])
    text = render(live)
    assert "version — reward —" in text and "buffer nan/256 samples (nan)" in text
    assert live.progress.tasks[0].completed == 10  # no step number: the bar stays
