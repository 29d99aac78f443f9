"""A generator started by hand joins a live run (`asyncrl generator`), its samples
reach the learner, `asyncrl status` sees it, and stopping it loses nothing. The run trains
LoRA adapters, published alone: the joined replica starts from the base and must apply
the version it fetches, or its samples would be refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import yaml

from asyncrl.run.status import read_metrics
from tests.helpers.launches import REPO
from tests.helpers.run_processes import processes_of
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

STEPS = 150


def metrics_lines(run_dir) -> int:
    return len(read_metrics(run_dir))


def test_a_generator_joins_mid_run_and_leaves_without_loss(tmp_path):
    run_dir = tmp_path / "run"
    pools = "generators.pools=[{name: main, replicas: 1}, {name: extra, replicas: 0}]"
    launcher = subprocess.Popen(
        [
            sys.executable, "-m", "asyncrl", "launch", str(REPO / "configs/quickstart.yaml"),
            f"run.total_steps={STEPS}", "tracking.aim=false", pools, "model.lora.rank=8",
            "--run-dir", str(run_dir), "--quiet",
        ],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    joined = None
    try:
        wait_until(lambda: metrics_lines(run_dir) >= 2, 120, what="the first steps", every_s=0.2)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        buffer = f"tcp://127.0.0.1:{config['cluster']['buffer_port']}"
        log = (tmp_path / "joined.log").open("w")
        joined = subprocess.Popen(
            [
                sys.executable, "-m", "asyncrl", "generator",
                "--config", str(run_dir / "config.yaml"), "--buffer", buffer,
                "--pool", "extra", "--work-dir", str(tmp_path / "joined"),
            ],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

        def extra_sent() -> float:
            records = read_metrics(run_dir)
            return records[-1].get("pool_extra_samples_sent_total", 0.0) if records else 0.0

        wait_until(
            lambda: extra_sent() > 0, 120, what="the joined generator's samples", every_s=0.2
        )
        status = subprocess.run(
            [sys.executable, "-m", "asyncrl", "status", str(run_dir)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "[live]" in status.stdout and "extra-" in status.stdout, status.stdout

        joined.send_signal(signal.SIGTERM)  # mid-run: its unfinished groups go back
        assert joined.wait(30) == 0
        output, _ = launcher.communicate(timeout=300)
        assert launcher.returncode == 0, output
    finally:
        for process in (joined, launcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()

    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["samples_total"] == STEPS * 256  # every step got a full batch
    assert records[-1]["pool_extra_samples_sent_total"] > 0
    assert records[-1]["pool_main_samples_sent_total"] > 0
    assert records[-1]["buffer_refused_adapter"] == 0.0  # the joined replica applied them
    assert records[-1]["pool_extra_weight_swaps_total"] >= 1
    joined_log = (tmp_path / "joined.log").read_text()
    assert "joined run" in joined_log and "left the run" in joined_log, joined_log
    trained = [
        group for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()
        for group in json.loads(line)["group_ids"]
    ]  # fmt: skip
    assert len(trained) == len(set(trained))  # no prompt trained twice
    finished = subprocess.run(
        [sys.executable, "-m", "asyncrl", "status", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert finished.returncode == 0 and "[finished]" in finished.stdout, finished.stdout
    assert not processes_of(run_dir)
