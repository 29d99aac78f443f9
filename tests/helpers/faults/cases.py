"""What one fault did to a run (:class:`Case`), and the steps that fill one in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tests.helpers.faults.launch import Launch
from tests.helpers.faults.ledger import checkpoint_step, skipped_prompts


@dataclass
class Case:
    """What one fault did to a run: the test asserts on it, the table reports it."""

    fault: str
    status: int | None = None
    """The launcher's exit status (None when the launcher itself was killed)."""
    message: str = ""
    """The line(s) that name the fault, as printed."""
    went_on: bool = False
    """The run trained on past the fault (as against stopping)."""
    seconds: float | None = None
    """Fault to the run going on again (the faulty part back or contained), or fault to
    the last process of the run gone when it stopped."""
    held_up_s: float | None = None
    """The longest the learner went without a step from the fault on."""
    steps_done: int = 0
    """Steps trained when the run stopped (all attempts)."""
    checkpoint: int | None = None
    """The step of the checkpoint a resume starts from."""
    skipped: list[dict] = field(default_factory=list)
    """Prompts given up on, by id (``skipped_prompts.jsonl``)."""
    leftovers: list[str] = field(default_factory=list)
    """Processes of the run alive after its launcher exited (or after the stop)."""
    resumed_from: int | None = None
    """The checkpoint step the next ``--resume`` started from (None: not resumed)."""
    resumed: int | None = None
    """The exit status of the ``--resume`` that completed the run (None: not resumed)."""
    notes: dict[str, object] = field(default_factory=dict)
    """Figures of this fault (reward errors, aim failures, log growth ...)."""

    @property
    def lost_steps(self) -> int | None:
        """Trained steps that the checkpoint a resume starts from does not hold."""
        return None if self.checkpoint is None else self.steps_done - self.checkpoint


def metric(launch: Launch, name: str) -> float:
    """The latest value of a metric (0 before any step carries it)."""
    for record in reversed(launch.metrics()):
        if record.get(name) is not None:
            return record[name]
    return 0.0


def metric_reaches(launch: Launch, name: str, value: float) -> Callable[[], bool]:
    return lambda: metric(launch, name) >= value


def lines_with(text: str, *words: str) -> str:
    """The lines of ``text`` holding any of ``words`` (case-insensitive)."""
    lines = [line for line in text.splitlines() if any(w.lower() in line.lower() for w in words)]
    return "\n".join(lines)


def settle(launch: Launch, steps: int = 2) -> None:
    """A few more steps: the run trains on."""
    launch.wait_for_new_steps(launch.new_steps() + steps)


def stopped_cleanly(launch: Launch, *cases: Case) -> None:
    """SIGTERM to the launcher; its status, the leftovers and what was skipped, into ``cases``."""
    status = launch.stop()
    for case in cases:
        case.status = status
        case.steps_done = launch.trained_to()
        case.checkpoint = checkpoint_step(launch.run_dir)
        case.skipped = skipped_prompts(launch.run_dir)
        case.leftovers = launch.leftovers()


def restarts(launch: Launch, count: int) -> Callable[[], bool]:
    """True once a step carried samples of a replica restarted ``count`` times in all."""
    return metric_reaches(launch, "generators_restarts_total", count)
