"""`asyncrl status` on a run directory, without a live buffer."""

from __future__ import annotations

import io
import json

from rich.console import Console

from asyncrl.config import load_config, save_config
from asyncrl.run.status import read_metrics, show


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


def status_text(run_dir, lines: list[bytes]) -> str:
    config = load_config(None, ["model.tiny.hidden_size=64", "run.total_steps=20"])
    save_config(config, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = io.StringIO()
    assert show(run_dir, Console(file=out, width=200)) == 0
    return out.getvalue()


def table_rows(text: str) -> dict[str, list[str]]:
    """The recent-steps table: step -> the other cells."""
    recent = text.split("recent steps", 1)[1].splitlines()
    cells = [line.strip("│ ").split("│") for line in recent if line.startswith("│")]
    return {row[0].strip(): [cell.strip() for cell in row[1:]] for row in cells}


def test_status_shows_null_non_finite_string_and_missing_figures(tmp_path):
    """A NaN batch (reward null), non-finite and string figures, missing keys:
    `asyncrl status` shows them as —, nan or inf and does not raise."""
    nan, inf = float("nan"), float("inf")
    records = [
        record(0),
        {**record(1), "reward_mean": None, "staleness_mean": nan, "samples_per_s": inf},
        {"step": 2},
        {**record(3), "version": None, "staleness_max": "one", "samples_per_s": -inf},
        {
            **record(4), "eval_round": None, "eval_policy_version": nan,
            "eval_reward_mean": "0.4", "eval_samples": inf,
        },
    ]  # fmt: skip
    text = status_text(tmp_path, [json.dumps(r).encode() for r in records])
    assert "step 5/20, version 5" in text
    assert "latest eval: round — of version nan, reward — over inf held-out samples" in text
    rows = table_rows(text)
    assert rows["2"] == ["2", "—", "nan/1", "inf"]
    assert rows["3"] == ["—", "—", "—/—", "—"]
    assert rows["4"] == ["—", "0.500", "1.00/—", "-inf"]


def test_status_skips_metrics_lines_that_are_not_json_objects(tmp_path):
    good = [json.dumps(record(step)).encode() for step in range(2)]
    text = status_text(
        tmp_path, [good[0], b'{"step": 1, "cut by a crash', b"[1, 2]", b"\xff", good[1]]
    )
    assert "step 2/20, version 2" in text
    assert list(table_rows(text)) == ["1", "2"]


def test_status_of_a_directory_with_a_broken_config_names_the_file(tmp_path):
    (tmp_path / "config.yaml").write_text("model: {tiny: {}}\nrun: {total_steps: -1}\n")
    out = io.StringIO()
    assert show(tmp_path, Console(file=out, width=300)) == 2
    assert out.getvalue().startswith(f"asyncrl: {tmp_path / 'config.yaml'}: ")
    assert "run.total_steps" in out.getvalue()
