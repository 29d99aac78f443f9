"""Checks run before any process starts: what would otherwise fail in a role's log.

Without them a bad prompt file shows up as a traceback in ``logs/buffer.log``
after the launcher started every role, and a ``reward.function`` that cannot
load makes every generator fail at start-up and restart for ever. So
``asyncrl launch`` and ``asyncrl validate`` call :func:`preflight` first; it
raises :class:`PreflightError` with one line per problem, each naming the
config key and, for data, the file and row:

- every prompt file the run reads (``data.train_files``; ``eval.files`` when
  ``eval`` is on): each row's JSON and fields, and each prompt rendered with the
  policy tokenizer's chat template (the tokenizer only, no model; at most
  :data:`RENDER_LIMIT` rows a file, so a big dataset stays quick);
- the reward function: ``reward.function`` (and an environment's named one) is
  imported and called on the first row of each data source, with its ground truth
  as the response, so one that raises, hangs, crashes, or scores outside
  ``reward.min``..``reward.max`` is named with the row; without it, each row's
  ``data_source`` needs a built-in (:func:`asyncrl.generation.rewards.builtin_reward_function`)
  whose rewards fit that range;
- the ``environment``, when set: built once (its tools resolved, its reward
  function loaded), running no model, and its turn formatter built on the tokenizer.

The user's modules (reward functions, environments) are imported only in a
contained child (:mod:`asyncrl.generation.plugin_check`), under ``reward.load_timeout_s``
(a call: ``reward.timeout_s``) and ``reward.memory_limit_mb``: one that hangs,
crashes, allocates past the limit or stops its parent at import is one problem
naming it, and no process of it is left; this process never imports them.
- this machine (:func:`machine_checks`): what it cannot give the run
  (:func:`asyncrl.core.machine.machine_problems`) and the python tool's sandbox.
  ``asyncrl validate`` shows these as warnings: a config may be meant for
  another machine.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.config.base import one_line
from asyncrl.core.machine import machine_problems

if TYPE_CHECKING:
    from asyncrl.generation.data import DataError, Row

RENDER_LIMIT = 5000
"""Rows of each prompt file rendered with the chat template (every row's JSON and
fields are checked); the buffer renders the rest when it starts."""
PROBLEMS_PER_FILE = 5
"""Bad rows listed per file; more are counted in one line."""
REWARD_SAMPLES = 4
"""Data sources whose first row the reward function is called on."""
GIVEN = " (given its ground truth as the response)"
_FAILURES = {
    "error:exception": "raised",
    "error:timeout": "hung",
    "error:crashed": "crashed its worker process",
    "error:bad_return": "returned no finite number",
}
"""How a reward worker's error tag reads in a problem."""


class PreflightError(ValueError):
    """The run cannot start; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [one_line(problem) for problem in problems]  # whatever a path holds
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Sample:
    """A row the reward function is called on, and where it came from."""

    where: str
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)


def preflight(config: Config, *, data: bool = True, machine: bool = True) -> list[str]:
    """Raise :class:`PreflightError` listing every problem found; else return what was
    found worth saying (each prompt file's prompt form: chat messages or plain text).

    ``data``: read the prompt files and load the tokenizer (without it a data
    run's reward function is loaded, not called). ``machine``: include
    :func:`machine_checks`.
    """
    problems: list[str] = []
    notes: list[str] = []
    samples: list[Sample] = []
    tokenizer = _Tokenizer(config)
    if not config.data.train_files:
        samples.append(task_sample(config))
    elif data:
        rows: dict[str, Row] = {}
        problems += check_data(config, tokenizer, rows, notes)
        samples += [_row_sample(row) for row in rows.values()]
    environment_problems, environment_score = check_environment(config, tokenizer, data)
    problems += environment_problems
    problems += check_rewards(config, samples, environment_score)
    if tokenizer.problem is not None:
        problems.insert(0, tokenizer.problem)
    if machine:
        problems += machine_checks(config)
    if problems:
        raise PreflightError(list(dict.fromkeys(problems)))  # each once (train and eval)
    return notes


def machine_checks(config: Config) -> list[str]:
    """What this machine cannot give the run: cores, GPUs
    (:func:`~asyncrl.core.machine.machine_problems`), peft for LoRA, the python tool's
    sandbox."""
    problems = machine_problems(config)
    if config.model.lora is not None and importlib.util.find_spec("peft") is None:
        from asyncrl.generation.lora import LoraUnavailable

        problems.append(f"model.lora: {LoraUnavailable.advice}")
    if config.environment is not None:
        from asyncrl.generation.envs.sandbox import SandboxUnavailable, check_isolation_for

        try:
            check_isolation_for(config)
        except SandboxUnavailable as error:
            problems.append(f"environment.python_isolation: {_text(error)}")
    return problems


def _text(error: BaseException) -> str:
    from asyncrl.generation.data import one_line

    return one_line(error, typed=not isinstance(error, ValueError | OSError))


class _Tokenizer:
    """The policy's tokenizer, loaded on first use; failing to load is one problem."""

    def __init__(self, config: Config):
        self.config = config
        self.loaded = False
        self.value: Any = None
        self.problem: str | None = None

    def get(self) -> Any:
        if not self.loaded:
            self.loaded = True
            from asyncrl.generation.tasks import prompt_tokenizer

            name = self.config.model.name_or_path
            if name is not None and _local(name) and not Path(name).expanduser().exists():
                self.problem = f"model.name_or_path: no such folder or file {name}"
                return None
            try:
                self.value = prompt_tokenizer(self.config)
            except Exception as error:
                self.problem = (
                    f"model.name_or_path: cannot load the tokenizer of "
                    f"{self.config.model.name_or_path}: {_text(error)}"
                )
        return self.value


def _local(name: str) -> bool:
    """Whether ``model.name_or_path`` can only mean a local path (not a Hub name)."""
    return name.startswith(("/", "./", "../", "~")) or name.lower().endswith(".gguf")


# --------------------------------------------------------------------------
# prompt files


def check_data(
    config: Config, tokenizer: _Tokenizer, first_rows: dict[str, Row], notes: list[str]
) -> list[str]:
    """Problems of the prompt files the run reads. ``first_rows`` gets each data
    source's first row (to call the reward function on); ``notes`` each file's form."""
    groups = [("data.train_files", config.data.train_files)]
    if config.eval.enabled:
        groups.append(("eval.files", config.eval.files))
    problems: list[str] = []
    for key, files in groups:
        check = _FilesCheck(key, config.data.max_prompt_tokens, first_rows)
        if any(Path(path).is_file() for path in files):
            check.use_tokenizer(config, tokenizer)
        for path in files:
            check.file(path)
        problems += check.problems + check.none_fits()
        notes += check.form_notes()
        if config.environment is not None:
            problems += check.text_for_environment()
    return problems + _unscored_sources(config, first_rows.values())


@dataclass
class _FilesCheck:
    """Checks the files under one config key, counting how their prompts render."""

    key: str
    limit: int
    first_rows: dict[str, Row]
    template: Any = None
    """The tokenizer, once it loaded."""
    model: str = ""
    """What the tokenizer is, for messages."""
    forms: dict[str, Counter] = field(default_factory=dict)
    """Per file, its rows by prompt form (``chat``, ``text``)."""
    problems: list[str] = field(default_factory=list)
    rows: int = 0
    rendered: int = 0
    fitting: int = 0
    shortest: int | None = None

    def use_tokenizer(self, config: Config, tokenizer: _Tokenizer) -> None:
        """Render with ``tokenizer`` (chat rows need its chat template: a file of them
        without one is a problem)."""
        if tokenizer.get() is not None:
            self.template = tokenizer.value
            name = config.model.name_or_path
            self.model = name if name else "model.tiny (its built-in tokenizer)"

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.template, "chat_template", None) is not None

    def file(self, path: str) -> None:
        """Check every row of ``path``; render up to :data:`RENDER_LIMIT` of them."""
        from asyncrl.generation.data import DataError, scan_rows

        bad = rendered = 0
        forms = self.forms.setdefault(path, Counter())
        try:
            for item in scan_rows(path):
                self.rows += 1
                if not isinstance(item, DataError):
                    forms[item.form] += 1
                    self.first_rows.setdefault(item.data_source, item)
                    if item.form == "chat" and not self.has_chat_template:
                        continue  # one problem for the file, below
                    if self.template is not None and rendered < RENDER_LIMIT:
                        rendered += 1
                        item = self._render(item)
                if isinstance(item, DataError):
                    bad += 1
                    if bad <= PROBLEMS_PER_FILE:
                        self.problems.append(f"{self.key}: {item}")
        except DataError as error:  # the file itself: missing, unreadable, empty
            self.problems.append(f"{self.key}: {error}")
        if bad > PROBLEMS_PER_FILE:
            more = bad - PROBLEMS_PER_FILE
            self.problems.append(f"{self.key}: {path}: {more} more bad rows not listed")
        if forms["chat"] and self.template is not None and not self.has_chat_template:
            self.problems.append(
                f"{self.key}: {path}: {forms['chat']} chat-message prompts, and the tokenizer "
                f"of {self.model} has no chat template (a base model?): give 'prompt' as a "
                "plain string, or use a model whose tokenizer has one"
            )
        self.rendered += rendered

    def _render(self, row: Row) -> Row | DataError:
        """``row`` after counting its rendered length, or the template's error."""
        from asyncrl.generation.data import DataError, render_row

        try:
            length = len(render_row(self.template, row))
        except DataError as error:
            return error
        self.fitting += length <= self.limit
        self.shortest = length if self.shortest is None else min(self.shortest, length)
        return row

    def form_notes(self) -> list[str]:
        """Which form each file's prompts take (how they are rendered)."""
        how = {
            "chat": "chat messages (the chat template)",
            "text": "plain text (as it is, the tokenizer's BOS rule)",
        }
        return [
            f"{self.key}: {path}: "
            + ", ".join(f"{count} rows of {how[form]}" for form, count in sorted(forms.items()))
            for path, forms in self.forms.items()
            if forms
        ]

    def text_for_environment(self) -> list[str]:
        """An environment's episodes start from chat messages: plain text cannot."""
        return [
            f"{self.key}: {path}: {forms['text']} plain-text prompts, but an environment "
            "renders its turns from chat messages: give 'prompt' as messages"
            for path, forms in self.forms.items()
            if forms["text"]
        ]

    def none_fits(self) -> list[str]:
        """Every row rendered and none fits in the limit: the buffer would refuse them."""
        if self.problems or not self.rows or self.rendered < self.rows or self.fitting:
            return []
        return [
            f"{self.key}: none of the {self.rows} prompts fits in data.max_prompt_tokens="
            f"{self.limit} once rendered (the shortest has "
            f"{self.shortest} tokens)"
        ]


def _unscored_sources(config: Config, rows: Iterable[Row]) -> list[str]:
    """Without ``reward.function``: each data source that has no built-in function (at
    its first row), or whose built-in scores outside ``reward.min``..``reward.max``."""
    if config.reward.function:
        return []
    from asyncrl.generation.rewards import builtin_reward_function, known_data_sources, reward_range

    problems = []
    low, high = config.reward.min, config.reward.max
    for row in rows:
        function = builtin_reward_function(row.data_source)
        if function is None:
            problems.append(
                f"reward.function: {row.source}: no built-in reward function for data_source "
                f"{row.data_source!r} (built in: {known_data_sources()}); set "
                "reward.function to module:function or path/to/file.py:function"
            )
            continue
        lowest, highest = reward_range(function)
        if not low <= lowest <= highest <= high:
            problems.append(
                f"reward.min, reward.max: {row.source}: data_source {row.data_source!r} is "
                f"scored by {function.__name__}, which gives {lowest:g}..{highest:g}, outside "
                f"{low:g}..{high:g}: the buffer would refuse such samples"
            )
    return problems


def _row_sample(row: Row) -> Sample:
    return Sample(row.source, row.data_source, row.ground_truth, dict(row.extra_info))


def task_sample(config: Config) -> Sample:
    """The built-in task's first prompt, as the generators would score it."""
    from asyncrl.generation.tasks import DigitsTask

    prompt = DigitsTask(config.task, config.run.seed).prompt(0)
    return Sample(f"task.{config.task.name} prompt 0", prompt.data_source, prompt.ground_truth)


# --------------------------------------------------------------------------
# the environment and the reward function


def check_environment(
    config: Config, tokenizer: _Tokenizer, formatter: bool = True
) -> tuple[list[str], str | None]:
    """Problems building ``environment`` (in a contained child: it imports the user's
    modules; no model runs) and, with ``formatter``, its turn formatter on the tokenizer;
    and the name of its own reward function when it has one that is not built in."""
    environment = config.environment
    if environment is None:
        return [], None
    from asyncrl.generation.envs.formatting import build_formatter
    from asyncrl.generation.envs.tool_env import DEFAULT_SCORE
    from asyncrl.generation.plugin_check import Check, run_checks

    check = Check("environment", environment.name, (environment.model_dump(mode="json"),))
    (outcome,) = run_checks([check], **_limits(config))
    problems = [] if outcome.problem is None else [f"environment: {outcome.problem}"]
    needs_tokenizer = formatter and environment.formatter in ("template", "auto")
    if needs_tokenizer and tokenizer.get() is not None:
        try:
            build_formatter(environment.formatter, tokenizer.value)
        except Exception as error:
            problems.append(f"environment.formatter: {_text(error)}")
    score_function = outcome.value
    if not isinstance(score_function, str) or score_function == DEFAULT_SCORE:
        score_function = None
    return problems, score_function


def check_rewards(
    config: Config, samples: list[Sample], environment_score: str | None = None
) -> list[str]:
    """Load ``reward.function`` (and ``environment_score``) and call it on each sample, in
    one contained child (:mod:`asyncrl.generation.plugin_check`): the built-ins are trusted,
    not called."""
    functions = {"reward.function": config.reward.function}
    functions["environment.kwargs.compute_score"] = environment_score
    functions = {key: name for key, name in functions.items() if name}
    if not functions:
        return []
    from asyncrl.generation.plugin_check import Check, run_checks

    checks = [(key, None, Check("reward", name)) for key, name in functions.items()]
    for sample in samples[:REWARD_SAMPLES]:
        args = (sample.data_source, sample.ground_truth, sample.ground_truth, sample.extra_info)
        checks += [(key, sample, Check("score", name, args)) for key, name in functions.items()]
    outcomes = run_checks([check for _, _, check in checks], **_limits(config))
    problems: list[str] = []
    for (key, sample, check), outcome in zip(checks, outcomes, strict=True):
        if outcome.problem is not None:
            where = "" if sample is None else f"{sample.where}: "
            problems.append(f"{key}: {where}{outcome.problem}")
        elif sample is not None and outcome.value is not None:
            problems += _score_problem(config, key, sample, check.subject, outcome.value)
    return problems


def _limits(config: Config) -> dict[str, Any]:
    """The child's limits: the reward section's."""
    reward = config.reward
    return {
        "timeout_s": reward.timeout_s,
        "load_timeout_s": reward.load_timeout_s,
        "memory_limit_mb": reward.memory_limit_mb,
    }


def _score_problem(config: Config, key: str, sample: Sample, name: str, value: list) -> list[str]:
    """The problem, if any, of the score ``name`` gave ``sample`` (its ground truth as the
    response): ``value`` is ``[reward, error tag or None, detail]``."""
    reward, error, detail = value
    if error is not None:
        failed = _FAILURES.get(error, f"failed ({error})")
        return [f"{key}: {sample.where}: {name} {failed} on this row{GIVEN}: {detail}"]
    low, high = config.reward.min, config.reward.max
    if not low <= reward <= high:
        return [
            f"{key}: {sample.where}: {name} scored {reward:g} on this row{GIVEN}, outside "
            f"reward.min..reward.max = {low:g}..{high:g}: the buffer would refuse such samples"
        ]
    return []
