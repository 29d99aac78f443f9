"""Reward functions, and the scorer that runs them off the generation path.

A reward function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

and returns a number (or a dict with a ``"score"`` entry, as verl allows).
``reward.function`` names one (``module:function`` or ``path/to/file.py:function``)
for every row; left empty, each row's ``data_source`` picks a built-in from
:data:`REWARD_FUNCTIONS`:

================================================  ===========================
data_source                                       scorer
================================================  ===========================
``synthetic/digits``                              :func:`asyncrl.tasks.digits_score`
``openai/gsm8k``, ``gsm8k``                       :func:`gsm8k_score` (``#### 42``)
``lighteval/MATH``, ``DigitalLearningGmbH/        :func:`math_score` (last ``\\boxed{}``)
MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
``math``
================================================  ===========================

:class:`RewardScorer` runs the functions in worker processes (``spawn``), so a
slow function never holds up generation, and a hung one can be killed: each
sample gets ``timeout_s``; past it the worker is killed and replaced, and the
sample scores 0.0 tagged ``error:timeout``. A function that raises scores 0.0
tagged ``error:exception``. Tags are counted in ``scorer.counters`` and logged
(the first few of each kind with details); the run goes on.

Threads could not do this: a thread stuck in a reward function cannot be
stopped, and would keep its pool slot (and a core) for as long as it hangs.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import importlib.util
import itertools
import logging
import math
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NamedTuple

from asyncrl.tasks import digits_score

log = logging.getLogger("asyncrl.rewards")

RewardFunction = Callable[[str, str, str, Any], Any]


# --------------------------------------------------------------------------
# GSM8K: the number after "####"

_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def extract_gsm8k_answer(text: str, flexible: bool = False) -> str | None:
    """The number after the last ``####`` in ``text``, normalised; None if there is none.

    ``flexible``: with no ``####``, fall back to the last number anywhere in the text.
    """
    matches = _GSM8K_ANSWER.findall(text)
    if not matches and flexible:
        matches = re.findall(_NUMBER, text)
    return normalize_number(matches[-1]) if matches else None


def normalize_number(text: str) -> str:
    """``"$1,234.50"`` -> ``"1234.5"``: no commas, ``$`` or trailing ``.``/zeros."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the number after the response's last ``####`` equals the ground truth."""
    answer = extract_gsm8k_answer(solution_str)
    return float(answer is not None and answer == normalize_number(str(ground_truth)))


def gsm8k_score_flexible(
    data_source: str, solution_str: str, ground_truth: str, extra_info=None
) -> float:
    """Like :func:`gsm8k_score`, taking the last number when there is no ``####``."""
    answer = extract_gsm8k_answer(solution_str, flexible=True)
    return float(answer is not None and answer == normalize_number(str(ground_truth)))


# --------------------------------------------------------------------------
# MATH: the last \boxed{...}


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    ``\\boxed 5`` (no braces) gives ``5``; None when there is no box or it is unclosed.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" "):
        match = re.match(r" +([^\s$]+)", rest)
        return match.group(1) if match else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:index]
    return None


_TEXT_COMMANDS = r"\\(?:text|textbf|textrm|mbox|mathrm)"


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a MATH-style answer, so that equal answers compare equal.

    Removes spaces (and ``\\,`` ``\\;`` ``\\!``), ``\\left``/``\\right``, ``$``, ``%``,
    degrees (``^\\circ``), a trailing ``.``, a unit in a trailing ``\\text{...}``, a
    short left-hand side (``x = 5`` -> ``5``), thousands separators (``1,000``);
    unwraps ``\\text{...}``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\frac12`` ->
    ``\\frac{1}{2}``; ``\\sqrt3`` -> ``\\sqrt{3}``; ``a/b`` (integers) ->
    ``\\frac{a}{b}``; ``.5`` -> ``0.5``.
    """
    s = answer.strip().replace("\n", "")
    for command in ("\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(command, "")
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for degree in ("^{\\circ}", "^\\circ", "°"):
        s = s.replace(degree, "")
    for symbol in ("\\$", "$", "\\%", "%"):
        s = s.replace(symbol, "")
    unit = re.fullmatch(r"(.*\S)\s*" + _TEXT_COMMANDS + r"\{[^{}]*\}", s)
    if unit and not re.search(_TEXT_COMMANDS + r"\{", unit.group(1)):
        s = unit.group(1)  # "5 \text{ cm}" -> "5"; a whole answer "\text{(A)}" stays
    s = re.sub(_TEXT_COMMANDS + r"\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    fraction = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if fraction:
        s = f"\\frac{{{fraction.group(1)}}}{{{fraction.group(2)}}}"
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _numeric_value(s: str) -> float | None:
    """The value of a normalised answer that is a plain number or a numeric fraction."""
    if re.fullmatch(r"-?\d+(\.\d+)?", s):
        return float(s)
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if match and float(match.group(3)) != 0:
        value = float(match.group(2)) / float(match.group(3))
        return -value if match.group(1) else value
    return None


def math_equal(answer: str, truth: str) -> bool:
    """Equal after :func:`normalize_math_answer`, or numerically (``0.5`` == ``\\frac12``)."""
    a, b = normalize_math_answer(answer), normalize_math_answer(truth)
    if a == b:
        return True
    x, y = _numeric_value(a), _numeric_value(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response's last ``\\boxed{}`` equals the ground truth (itself boxed or not)."""
    answer = extract_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = extract_boxed(truth) or truth
    return float(math_equal(answer, truth))


# --------------------------------------------------------------------------
# the registry, and functions named in the config

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "synthetic/digits": digits_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math": math_score,
}
"""Built-in reward functions by ``data_source``, used when ``reward.function`` is empty."""


class RewardFunctionError(ValueError):
    """A ``reward.function`` that cannot be loaded; the message says why."""


def load_reward_function(spec: str) -> RewardFunction:
    """The function named ``module:function`` or ``path/to/file.py:function``.

    A file is loaded as a module of its own (relative paths from the current
    directory). Raises :class:`RewardFunctionError` naming what is wrong.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RewardFunctionError(
            f"reward function '{spec}': expected module:function or path/to/file.py:function"
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise RewardFunctionError(f"reward function '{spec}': no such file {path}")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module_name = f"asyncrl_reward_{digest}_{path.stem}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise RewardFunctionError(f"reward function '{spec}': cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException as error:
                del sys.modules[module_name]
                raise RewardFunctionError(
                    f"reward function '{spec}': loading {path} raised "
                    f"{type(error).__name__}: {error}"
                ) from error
        source = str(path)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise RewardFunctionError(
                f"reward function '{spec}': cannot import module '{where}': {error}"
            ) from error
        source = f"module '{where}'"
    if not hasattr(module, name):
        defined = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_")
        )
        raise RewardFunctionError(
            f"reward function '{spec}': {source} has no '{name}' "
            f"(callables there: {', '.join(defined) or 'none'})"
        )
    function = getattr(module, name)
    if not callable(function):
        raise RewardFunctionError(
            f"reward function '{spec}': '{name}' in {source} is a "
            f"{type(function).__name__}, not a function"
        )
    return function


def check_reward_sources(function: str | None, data_sources: Iterable[str]) -> None:
    """Fail early when some rows could not be scored: a bad ``reward.function``,
    or (with none) a ``data_source`` that has no built-in reward function."""
    if function:
        load_reward_function(function)
        return
    unknown = sorted(set(data_sources) - set(REWARD_FUNCTIONS))
    if unknown:
        raise RewardFunctionError(
            f"no built-in reward function for data_source {', '.join(map(repr, unknown))}; "
            f"built in: {', '.join(sorted(REWARD_FUNCTIONS))}. "
            "Set reward.function=module:function or path/to/file.py:function"
        )


# --------------------------------------------------------------------------
# scoring off the generation path


class Score(NamedTuple):
    """A sample's reward, with ``error`` set (and ``reward`` 0.0) when scoring failed."""

    reward: float
    error: str | None = None
    detail: str = ""


ERROR_EXCEPTION = "error:exception"
ERROR_TIMEOUT = "error:timeout"
ERROR_CRASHED = "error:crashed"
"""The worker process died while scoring (the function exited, or was killed)."""
ERROR_BAD_RETURN = "error:bad_return"
"""The function returned something that is not a finite number."""
ERROR_NO_FUNCTION = "error:no_reward_function"
"""No ``reward.function`` and no built-in for the row's ``data_source``."""

_LOGGED_PER_TAG = 5
_BATCH = 64


def _to_reward(value: Any) -> float:
    if isinstance(value, dict):
        value = value["score"]
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{reward} is not finite")
    return reward


def _score_one(function: RewardFunction | None, job: tuple) -> tuple[float, str | None, str]:
    """Run one job in the worker: ``(reward, error tag or None, detail)``."""
    data_source, solution_str, ground_truth, extra_info, *named = job
    if named and named[0]:  # the job's own function (an environment's); imported once
        try:
            function = load_reward_function(named[0])
        except Exception as error:
            return 0.0, ERROR_EXCEPTION, str(error)[:500]
    if function is None:
        function = REWARD_FUNCTIONS.get(data_source)
        if function is None:
            return 0.0, ERROR_NO_FUNCTION, f"no reward function for data_source {data_source!r}"
    try:
        value = function(data_source, solution_str, ground_truth, extra_info)
    except BaseException as error:  # SystemExit too: a reward function must not end the worker
        return 0.0, ERROR_EXCEPTION, f"{type(error).__name__}: {error}"[:500]
    try:
        return _to_reward(value), None, ""
    except Exception as error:
        return 0.0, ERROR_BAD_RETURN, f"returned {value!r:.100}: {error}"


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


_WORKER_COMMAND = (
    "import sys; from asyncrl.rewards import _worker_main; "
    "_worker_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))"
)


def _worker_main(fd: int, spec: str, parent_pid: int) -> None:
    """A scoring process: load the function, then score batches, one reply per sample."""
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        function = load_reward_function(spec) if spec else None
    except Exception as error:
        conn.send(("failed", str(error)))
        return
    conn.send(("ready", None))
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for job_id, job in batch:
            conn.send((job_id, _score_one(function, job)))


@dataclass
class _Job:
    id: int
    args: tuple
    future: Future


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    jobs: collections.deque = field(default_factory=collections.deque)
    deadline: float = math.inf


class RewardScorer:
    """Score samples in ``workers`` processes, ``timeout_s`` per sample.

    ``submit(...)`` returns at once with a :class:`concurrent.futures.Future` of a
    :class:`Score`; the future always completes, with a 0.0 ``Score`` tagged
    ``error:...`` when the function raised, hung or crashed::

        with RewardScorer("my_rewards.py:compute_score", timeout_s=5) as scorer:
            future = scorer.submit("openai/gsm8k", "... #### 42", "42", {})
            reward, error, _ = future.result()

    Worker processes start with the first sample. A background thread hands
    samples out in batches, enforces each sample's deadline (a hung worker is
    killed and replaced; its other samples go to the next worker) and fills the
    futures. ``function`` (``module:function`` or ``file.py:function``) is loaded
    here first, so a bad name fails at construction, not in a worker.
    """

    def __init__(self, function: str | None = None, timeout_s: float = 10.0, workers: int = 1):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        if function:
            load_reward_function(function)
            where, _, name = function.rpartition(":")
            if where.endswith(".py") or "/" in where or os.sep in where:  # workers: same file
                function = f"{Path(where).expanduser().resolve()}:{name}"
        self.function = function or None
        self.timeout_s = timeout_s
        self.num_workers = workers
        self.counters: collections.Counter[str] = collections.Counter()
        """``scored``, ``errors``, one entry per error tag, ``workers_started``."""
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._ids = itertools.count()
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._wake_recv, self._wake_send = multiprocessing.connection.Pipe(duplex=False)
        self._closed = False
        self._failed: str | None = None
        self._startup_failures = 0

    @classmethod
    def from_config(cls, config) -> RewardScorer:
        """From the ``reward`` section (:class:`asyncrl.config.RewardConfig`)."""
        return cls(config.function, config.timeout_s, config.workers)

    # -- the caller's side

    def submit(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: Any = None,
        function: str | None = None,
    ) -> Future:
        """Queue one sample; the returned future gives its :class:`Score`.

        ``function`` (``module:function`` or ``file.py:function``) scores this
        sample instead of the scorer's own (a multi-turn environment's reward)."""
        if self._closed:
            raise RuntimeError("the reward scorer is closed")
        if self._failed:
            raise RuntimeError(f"reward workers cannot start: {self._failed}")
        future: Future = Future()
        args = (data_source, solution_str, ground_truth, extra_info, function)
        job = _Job(next(self._ids), args, future)
        with self._lock:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._dispatch_loop, name="reward-scorer", daemon=True
                )
                self._thread.start()
        self._wake()
        return future

    def score_many(self, samples: Iterable[tuple]) -> list[Score]:
        """Score ``(data_source, solution_str, ground_truth, extra_info)`` tuples; blocks."""
        return [future.result() for future in [self.submit(*sample) for sample in samples]]

    def score(self, data_source, solution_str, ground_truth, extra_info=None) -> Score:
        return self.submit(data_source, solution_str, ground_truth, extra_info).result()

    def close(self) -> None:
        """Stop the workers (killing any still scoring); pending futures get ``error:closed``."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        pending = []
        for worker in list(self._workers):
            pending += list(worker.jobs)
            self._stop_worker(worker)
        self._workers.clear()
        with self._lock:
            pending, self._queue = pending + list(self._queue), collections.deque()
        for job in pending:
            self._finish(job, Score(0.0, "error:closed", "the scorer was closed"))
        self._wake_send.close()
        self._wake_recv.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the dispatcher thread

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_send.send_bytes(b"")

    def _dispatch_loop(self) -> None:
        try:
            while not self._closed:
                self._fill_workers()
                self._assign()
                now = time.monotonic()
                deadline = min((w.deadline for w in self._workers), default=math.inf)
                timeout = None if deadline == math.inf else max(0.0, deadline - now)
                ready = wait([self._wake_recv, *(w.conn for w in self._workers)], timeout)
                if self._wake_recv in ready:
                    while self._wake_recv.poll():
                        self._wake_recv.recv_bytes()
                for worker in list(self._workers):
                    if worker in self._workers and worker.conn in ready:
                        self._receive(worker)
                now = time.monotonic()
                for worker in list(self._workers):
                    if worker.jobs and worker.deadline <= now:
                        self._timed_out(worker)
        except Exception as error:  # never leave futures hanging
            log.exception("reward scorer stopped")
            self._failed = f"{type(error).__name__}: {error}"
            with self._lock:
                pending, self._queue = list(self._queue), collections.deque()
            for worker in self._workers:
                pending += list(worker.jobs)
                worker.jobs.clear()
            for job in pending:
                self._finish(job, Score(0.0, "error:scorer", self._failed))

    def _fill_workers(self) -> None:
        while len(self._workers) < self.num_workers and not self._failed:
            ours, theirs = socket.socketpair()
            with ours, theirs:
                fd = theirs.fileno()
                command = [sys.executable, "-c", _WORKER_COMMAND, str(fd), self.function or ""]
                process = subprocess.Popen(
                    [*command, str(os.getpid())],
                    pass_fds=(fd,),
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
                )
                conn = Connection(ours.detach())
            self._workers.append(_Worker(process, conn))
            self.counters["workers_started"] += 1

    def _assign(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.jobs:
                continue
            with self._lock:
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            worker.jobs.extend(batch)
            worker.deadline = time.monotonic() + self.timeout_s
            try:
                worker.conn.send([(job.id, job.args) for job in batch])
            except Exception as error:  # e.g. extra_info that cannot be pickled
                worker.jobs.clear()
                worker.deadline = math.inf
                if isinstance(error, (OSError, EOFError)):
                    self._requeue(batch)
                    self._replace(worker, None)
                    continue
                for job in batch:
                    self._finish(job, Score(0.0, ERROR_EXCEPTION, f"cannot send: {error}"))

    def _receive(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                tag, payload = worker.conn.recv()
                if tag == "ready":
                    worker.ready = True
                    self._startup_failures = 0
                elif tag == "failed":
                    self._failed = payload
                    log.error("reward worker cannot start: %s", payload)
                    self._fail_everything(payload)
                    return
                else:
                    job = worker.jobs.popleft()
                    assert job.id == tag, (job.id, tag)
                    self._finish(job, Score(*payload))
                    worker.deadline = time.monotonic() + self.timeout_s if worker.jobs else math.inf
        except (EOFError, OSError):
            process = worker.process
            try:
                code = process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                code = None
            detail = f"the reward worker exited with code {code}"
            if not worker.ready:
                self._startup_failures += 1
                if self._startup_failures >= 3:
                    self._failed = f"{detail} while starting, {self._startup_failures} times"
                    log.error("reward workers cannot start: %s", self._failed)
                    self._fail_everything(self._failed)
                    return
            current = worker.jobs.popleft() if worker.jobs else None
            self._replace(
                worker, None if current is None else (current, Score(0.0, ERROR_CRASHED, detail))
            )

    def _timed_out(self, worker: _Worker) -> None:
        job = worker.jobs.popleft()
        detail = f"no reward after {self.timeout_s}s; the worker was killed and replaced"
        self._replace(worker, (job, Score(0.0, ERROR_TIMEOUT, detail)))

    def _replace(self, worker: _Worker, failed: tuple[_Job, Score] | None) -> None:
        """Stop ``worker``, settle its failed job, send its other jobs to the front of the queue."""
        self._stop_worker(worker)
        self._workers.remove(worker)
        self._requeue(list(worker.jobs))
        worker.jobs.clear()
        if failed is not None:
            self._finish(*failed)

    def _requeue(self, jobs: list[_Job]) -> None:
        with self._lock:
            self._queue.extendleft(reversed(jobs))

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            pending, self._queue = list(self._queue), collections.deque()
        for worker in self._workers:
            pending += list(worker.jobs)
            worker.jobs.clear()
            self._stop_worker(worker)
        self._workers.clear()
        for job in pending:
            self._finish(job, Score(0.0, "error:scorer", reason))

    @staticmethod
    def _stop_worker(worker: _Worker) -> None:
        process: subprocess.Popen = worker.process
        if process.poll() is None and not worker.jobs and worker.ready:
            with contextlib.suppress(OSError):
                worker.conn.send(None)  # idle: ask it to leave
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)
        if process.poll() is None:
            process.kill()  # scoring (maybe hung) or starting: no need to be polite
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        worker.conn.close()

    def _finish(self, job: _Job, score: Score) -> None:
        if score.error is None:
            self.counters["scored"] += 1
        else:
            self.counters["errors"] += 1
            self.counters[score.error] += 1
            if self.counters[score.error] <= _LOGGED_PER_TAG:
                data_source = job.args[0]
                log.warning(
                    "reward %s (data_source %r): %s", score.error, data_source, score.detail
                )
                if self.counters[score.error] == _LOGGED_PER_TAG:
                    log.warning("further %s errors are counted, not logged", score.error)
        if not job.future.done():
            job.future.set_result(score)
