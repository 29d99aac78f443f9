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

:class:`RewardScorer` runs the functions in worker processes, so a slow function
never holds up generation, and a hung one can be killed. Whatever a function does
costs at most the sample it is scoring, which scores 0.0 with a tag:

* it raises: ``error:exception``;
* it returns anything but a finite real number (``bool``, numpy's too, a numeric
  string, None, a list, NaN): ``error:bad_return``;
* it runs past ``timeout_s``: ``error:timeout``;
* it goes past ``memory_limit_mb`` of address space (``RLIMIT_AS``, set before the
  function is loaded): ``error:memory``;
* its process dies (``os._exit``, a signal): ``error:crashed``;
* it writes to the worker's channel to the scorer (every message is a
  length-prefixed JSON frame, checked on arrival): ``error:channel``.

In the last four cases the worker is replaced and the samples queued behind it go
to the new one. Tags are counted in ``scorer.counters`` and logged (the first few
of each kind with details); the run goes on. What a worker prints goes to a pipe
the scorer reads: counted in ``worker_output_bytes``, with the first 2 KiB of it
logged at most once a minute.

Threads could not do this: a thread stuck in a reward function cannot be
stopped, and would keep its pool slot (and a core) for as long as it hangs.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import itertools
import json
import logging
import math
import multiprocessing.connection
import numbers
import os
import pickle
import re
import reprlib
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from multiprocessing.connection import wait
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
"""The function returned something that is not a finite real number."""
ERROR_NO_FUNCTION = "error:no_reward_function"
"""No ``reward.function`` and no built-in for the row's ``data_source``."""
ERROR_MEMORY = "error:memory"
"""The function ran out of memory (``reward.memory_limit_mb``); its worker was replaced."""
ERROR_CHANNEL = "error:channel"
"""The worker sent something that is not a reply (the function wrote to the worker's
channel); the worker was replaced."""

_WORKER_ERRORS = frozenset({ERROR_EXCEPTION, ERROR_BAD_RETURN, ERROR_NO_FUNCTION, ERROR_MEMORY})
"""The tags a worker may put in a reply; any other makes the reply invalid."""

_LOGGED_PER_TAG = 5
_BATCH = 64
_DETAIL_CHARS = 500
_REPR_CHARS = 200

_FRAME = struct.Struct("!Q")
"""Every message on a worker's channel is this length, then that many bytes."""
_MAX_REPLY_BYTES = 1 << 16
"""A worker's replies are small; a longer frame means the channel carries garbage."""
_READ_BYTES = 1 << 20
_CHANNEL_FD = 512
"""Where a worker moves its channel: far from the low numbers a function might write to."""

_OUTPUT_KEEP_BYTES = 2048
"""Of what a worker prints, this much is kept for the log each time it goes idle."""
_OUTPUT_LOG_INTERVAL_S = 60.0
"""At most one excerpt of the workers' output is logged per interval; the rest is counted."""


def _clip(text: str, limit: int = _DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = _REPR_CHARS
_REPR.maxlevel = 3


def _short_repr(value: Any) -> str:
    """``repr`` cut to ~200 characters without building the whole of a huge str, list or dict
    (nor failing on an int too long to print)."""
    try:
        return _clip(_REPR.repr(value), _REPR_CHARS)
    except Exception:
        return f"<{type(value).__name__} object>"


def _describe(error: BaseException) -> str:
    """``Type: message``, clipped; an exception whose ``str`` fails still gets its type."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    name = type(error).__name__
    return _clip(f"{name}: {_clip(message, 2 * _DETAIL_CHARS)}" if message else name)


def _to_reward(value: Any) -> float:
    """``value`` as a reward: a finite real number (verl's ``{"score": x}`` too).

    Booleans (numpy's as well), numeric strings, None and containers are not
    rewards: taking them would hide a function that returns the wrong thing.
    """
    if isinstance(value, Mapping) and "score" in value:
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a {type(value).__name__} is not a real number")
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
            return 0.0, ERROR_EXCEPTION, _clip(str(error))
    if function is None:
        function = REWARD_FUNCTIONS.get(data_source)
        if function is None:
            return 0.0, ERROR_NO_FUNCTION, f"no reward function for data_source {data_source!r}"
    try:
        value = function(data_source, solution_str, ground_truth, extra_info)
    except MemoryError as error:
        return 0.0, ERROR_MEMORY, _describe(error)
    except BaseException as error:  # SystemExit too: a reward function must not end the worker
        return 0.0, ERROR_EXCEPTION, _describe(error)
    try:
        return _to_reward(value), None, ""
    except Exception as error:
        return 0.0, ERROR_BAD_RETURN, f"returned {_short_repr(value)}: {_describe(error)}"


# -- the worker's side of the channel


def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload)) + payload


def _read_exactly(channel: socket.socket, size: int) -> bytes | None:
    """``size`` bytes from ``channel``; None when it closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = channel.recv(min(size - len(data), _READ_BYTES))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _read_job_batch(channel: socket.socket) -> list | None:
    """The next batch from the scorer; None when it says stop or the channel closes."""
    header = _read_exactly(channel, _FRAME.size)
    payload = None if header is None else _read_exactly(channel, _FRAME.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


def _send_reply(channel: socket.socket, message: list) -> None:
    channel.sendall(_frame(json.dumps(message).encode()))


def _private_channel(fd: int) -> socket.socket:
    """The channel moved to a high, close-on-exec descriptor, the one it came on closed.

    Its number is then none that a function writing to "its" descriptors (3, 4, ...)
    would hit by accident, and no program the function starts inherits it.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = _CHANNEL_FD if soft == resource.RLIM_INFINITY else min(_CHANNEL_FD, soft - 1)
    if lowest <= fd:
        return socket.socket(fileno=fd)
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return socket.socket(fileno=moved)


def _limit_memory(megabytes: int) -> None:
    """Cap the worker's address space, so that a runaway function gets a MemoryError (or
    is killed) instead of taking the host's memory."""
    if megabytes <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = megabytes << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


_WORKER_COMMAND = (
    "import sys; from asyncrl.rewards import _worker_main; "
    "_worker_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))"
)


def _worker_main(fd: int, spec: str, parent_pid: int, memory_limit_mb: int = 0) -> None:
    """A scoring process: load the function, then score batches, one reply per sample.

    stdin is /dev/null and stdout/stderr a pipe the scorer reads (bounded), so the
    only way onto the channel is a deliberate write to its descriptor.
    """
    channel = _private_channel(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _limit_memory(memory_limit_mb)
    try:
        function = load_reward_function(spec) if spec else None
    except Exception as error:
        _send_reply(channel, ["failed", _clip(str(error), 4 * _DETAIL_CHARS)])
        return
    _send_reply(channel, ["ready"])
    while (batch := _read_job_batch(channel)) is not None:
        for job_id, job in batch:
            reward, error, detail = _score_one(function, job)
            _send_reply(channel, [job_id, reward, error, detail])
            if error == ERROR_MEMORY:
                return  # the heap may be in a bad way: the scorer starts a fresh worker


# -- the scorer's side


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} in a reply")


def _decode_reply(payload: bytes) -> list:
    """A worker's message, checked: ``["ready"]``, ``["failed", reason]`` or
    ``[job id, reward, error tag or None, detail]``. ValueError for anything else."""
    message = json.loads(payload, parse_constant=_reject_constant)
    match message:
        case ["ready"] | ["failed", str()]:
            return message
        case [int() as job_id, float() as reward, None | str() as error, str() as detail]:
            if isinstance(job_id, bool) or not math.isfinite(reward):
                raise ValueError(f"a reply with job {job_id!r} and reward {reward!r}")
            if error is not None and error not in _WORKER_ERRORS:
                raise ValueError(f"a reply with an unknown error tag {_short_repr(error)}")
            return [job_id, reward, error, _clip(detail)]
    raise ValueError(f"not a reply: {_short_repr(message)}")


def _take_frames(inbox: bytearray) -> Iterator[bytes]:
    """The complete frames at the front of ``inbox``, each removed as it is taken (a partial
    one stays). ValueError, once the frames before it are taken, for a frame longer than
    any reply: garbage on the channel, which must not cost the replies that came first."""
    while len(inbox) >= _FRAME.size:
        (size,) = _FRAME.unpack_from(inbox)
        if size > _MAX_REPLY_BYTES:
            raise ValueError(f"a frame of {size} bytes; replies are at most {_MAX_REPLY_BYTES}")
        end = _FRAME.size + size
        if len(inbox) < end:
            return
        frame = bytes(inbox[_FRAME.size : end])
        del inbox[:end]
        yield frame


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"the reward worker was killed by {signal.Signals(-code).name}"
    return f"the reward worker exited with code {code}"


@dataclass
class _Job:
    id: int
    args: tuple
    future: Future


@dataclass
class _Worker:
    process: subprocess.Popen
    channel: socket.socket
    ready: bool = False
    jobs: collections.deque = field(default_factory=collections.deque)
    deadline: float = math.inf
    inbox: bytearray = field(default_factory=bytearray)
    """Bytes read from the channel that do not make a whole frame yet."""
    output_fd: int | None = None
    """The read end of the worker's stdout and stderr; None once it is closed."""
    output: bytearray = field(default_factory=bytearray)
    output_bytes: int = 0


class RewardScorer:
    """Score samples in ``workers`` processes, ``timeout_s`` per sample.

    ``submit(...)`` returns at once with a :class:`concurrent.futures.Future` of a
    :class:`Score`; the future always completes, with a 0.0 ``Score`` tagged
    ``error:...`` when the function raised, hung, crashed, ran out of memory or
    returned something that is not a number::

        with RewardScorer("my_rewards.py:compute_score", timeout_s=5) as scorer:
            future = scorer.submit("openai/gsm8k", "... #### 42", "42", {})
            reward, error, _ = future.result()

    Worker processes start with the first sample, each limited to
    ``memory_limit_mb`` of address space. A background thread hands samples out
    in batches, enforces each sample's deadline, checks every message a worker
    sends, and fills the futures. A worker that hangs, dies, runs out of memory
    or sends anything but a well-formed reply is replaced: the sample it was
    scoring fails, its other samples go to the next worker. What workers print
    is read off a pipe and logged in short excerpts. ``function``
    (``module:function`` or ``file.py:function``) is loaded here first, so a bad
    name fails at construction, not in a worker.
    """

    def __init__(
        self,
        function: str | None = None,
        timeout_s: float = 10.0,
        workers: int = 1,
        memory_limit_mb: int = 4096,
    ):
        if timeout_s <= 0 or workers < 1 or memory_limit_mb < 1:
            raise ValueError(
                "need timeout_s > 0, workers >= 1 and memory_limit_mb >= 1, "
                f"got {timeout_s}, {workers}, {memory_limit_mb}"
            )
        if function:
            load_reward_function(function)
            where, _, name = function.rpartition(":")
            if where.endswith(".py") or "/" in where or os.sep in where:  # workers: same file
                function = f"{Path(where).expanduser().resolve()}:{name}"
        self.function = function or None
        self.timeout_s = timeout_s
        self.num_workers = workers
        self.memory_limit_mb = memory_limit_mb
        self.counters: collections.Counter[str] = collections.Counter()
        """``scored``, ``errors``, one entry per error tag, ``workers_started``,
        ``worker_output_bytes``."""
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._ids = itertools.count()
        self._workers: list[_Worker] = []
        self._thread: threading.Thread | None = None
        self._wake_recv, self._wake_send = multiprocessing.connection.Pipe(duplex=False)
        self._closed = False
        self._failed: str | None = None
        self._startup_failures = 0
        self._output_logged_at = -math.inf

    @classmethod
    def from_config(cls, config) -> RewardScorer:
        """From the ``reward`` section (:class:`asyncrl.config.RewardConfig`)."""
        return cls(config.function, config.timeout_s, config.workers, config.memory_limit_mb)

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
                self._wait_and_read()
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

    def _wait_and_read(self) -> None:
        """Wait for a wake-up, a message, output or the next deadline; read what came."""
        deadline = min((w.deadline for w in self._workers), default=math.inf)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        outputs = [w.output_fd for w in self._workers if w.output_fd is not None]
        ready = set(wait([self._wake_recv, *(w.channel for w in self._workers), *outputs], timeout))
        if self._wake_recv in ready:
            while self._wake_recv.poll():
                self._wake_recv.recv_bytes()
        for worker in list(self._workers):
            if worker.output_fd in ready:
                self._read_output(worker)
        for worker in list(self._workers):
            if worker in self._workers and worker.channel in ready:
                self._receive(worker)

    def _fill_workers(self) -> None:
        while len(self._workers) < self.num_workers and not self._failed:
            ours, theirs = socket.socketpair()
            with theirs:
                fd = theirs.fileno()
                command = [sys.executable, "-c", _WORKER_COMMAND, str(fd), self.function or ""]
                process = subprocess.Popen(
                    [*command, str(os.getpid()), str(self.memory_limit_mb)],
                    pass_fds=(fd,),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env={
                        **os.environ,
                        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                        "PYTHONUNBUFFERED": "1",  # output reaches the pipe as it is printed
                    },
                )
            output_fd = process.stdout.fileno()
            os.set_blocking(output_fd, False)
            self._workers.append(_Worker(process, ours, output_fd=output_fd))
            self.counters["workers_started"] += 1

    def _assign(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.jobs:
                continue
            with self._lock:
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            try:
                payload = pickle.dumps([(job.id, job.args) for job in batch])
            except Exception as error:  # e.g. extra_info that cannot be pickled
                for job in batch:
                    self._finish(job, Score(0.0, ERROR_EXCEPTION, f"cannot send: {error}"))
                continue
            worker.jobs.extend(batch)
            worker.deadline = time.monotonic() + self.timeout_s
            try:
                worker.channel.sendall(_frame(payload))
            except OSError:
                worker.jobs.clear()
                worker.deadline = math.inf
                self._requeue(batch)
                self._replace(worker, None)
                return  # self._workers changed under the loop; the next round goes on

    def _receive(self, worker: _Worker) -> None:
        """Read what the worker sent and act on each whole message; replace a worker that
        closed its channel or sent anything but a well-formed message."""
        try:
            data = worker.channel.recv(_READ_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._crashed(worker)
            return
        worker.inbox += data
        try:
            for frame in _take_frames(worker.inbox):
                if not self._handle(worker, _decode_reply(frame)):
                    return
        except ValueError as error:  # json's errors and UnicodeDecodeError are ValueErrors
            detail = (
                f"the reward worker sent something that is not a reply ({_clip(str(error), 200)});"
                " it was replaced. Does the reward function write to descriptors it did not open?"
            )
            self._lost(worker, ERROR_CHANNEL, detail)

    def _handle(self, worker: _Worker, message: list) -> bool:
        """Act on one checked message; False when the worker is gone after it."""
        if message[0] == "ready":
            if worker.ready:
                raise ValueError("a second 'ready'")
            worker.ready = True
            self._startup_failures = 0
            return True
        if message[0] == "failed":
            self._failed = message[1]
            log.error("reward worker cannot start: %s", message[1])
            self._fail_everything(message[1])
            return False
        job_id, reward, error, detail = message
        if not worker.ready or not worker.jobs or worker.jobs[0].id != job_id:
            expected = worker.jobs[0].id if worker.jobs else None
            raise ValueError(f"a reply for job {job_id}, expected {expected}")
        job = worker.jobs.popleft()
        if error == ERROR_MEMORY:
            detail = (
                f"{detail}: the reward function ran out of memory "
                f"(reward.memory_limit_mb={self.memory_limit_mb}); the worker was replaced"
            )
            self._replace(worker, (job, Score(0.0, error, detail)))
            return False
        self._finish(job, Score(reward if error is None else 0.0, error, detail))
        worker.deadline = time.monotonic() + self.timeout_s if worker.jobs else math.inf
        if not worker.jobs:
            self._flush_output(worker)
        return True

    def _crashed(self, worker: _Worker) -> None:
        try:
            code = worker.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        self._lost(worker, ERROR_CRASHED, _exit_description(code))

    def _lost(self, worker: _Worker, tag: str, detail: str) -> None:
        """Replace a worker that died or broke its channel: the sample it was scoring fails
        with ``tag``, its other samples are requeued. Three in a row that never got ready
        fail the scorer (the function cannot even load)."""
        if not worker.ready:
            self._startup_failures += 1
            if self._startup_failures >= 3:
                self._failed = f"{detail} while starting, {self._startup_failures} times"
                log.error("reward workers cannot start: %s", self._failed)
                self._fail_everything(self._failed)
                return
        current = worker.jobs.popleft() if worker.jobs else None
        if current is None:
            log.warning("reward worker replaced: %s", detail)
        self._replace(worker, None if current is None else (current, Score(0.0, tag, detail)))

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

    def _stop_worker(self, worker: _Worker) -> None:
        process = worker.process
        if process.poll() is None and not worker.jobs and worker.ready:
            with contextlib.suppress(OSError):
                worker.channel.sendall(_frame(pickle.dumps(None)))  # idle: ask it to leave
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)
        if process.poll() is None:
            process.kill()  # scoring (maybe hung) or starting: no need to be polite
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        worker.channel.close()
        for _ in range(8):  # what it printed last (a traceback, say) is worth a look
            if worker.output_fd is None or not self._read_output(worker):
                break
        self._flush_output(worker)
        if worker.output_fd is not None:
            self._close_output(worker)

    # -- what workers print

    def _read_output(self, worker: _Worker) -> bool:
        """Read some of the worker's output, keeping the first few KiB; False when there was
        nothing to read (the pipe is empty, or closed, and then closed here too)."""
        try:
            chunk = os.read(worker.output_fd, _READ_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            self._close_output(worker)
            return False
        worker.output_bytes += len(chunk)
        room = _OUTPUT_KEEP_BYTES - len(worker.output)
        if room > 0:
            worker.output += chunk[:room]
        return True

    def _close_output(self, worker: _Worker) -> None:
        worker.output_fd = None
        worker.process.stdout.close()

    def _flush_output(self, worker: _Worker) -> None:
        """Count what the worker printed, and log the start of it if no excerpt was logged
        in the last minute: a chatty function cannot flood the generator's log."""
        if not worker.output_bytes:
            return
        self.counters["worker_output_bytes"] += worker.output_bytes
        now = time.monotonic()
        if now - self._output_logged_at >= _OUTPUT_LOG_INTERVAL_S:
            self._output_logged_at = now
            shown = worker.output.decode(errors="replace")
            more = worker.output_bytes - len(worker.output)
            log.info(
                "reward worker %d printed %d bytes%s (one excerpt a minute is logged):\n%s",
                worker.process.pid,
                worker.output_bytes,
                f", {more} not shown" if more else "",
                shown,
            )
        worker.output.clear()
        worker.output_bytes = 0

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
