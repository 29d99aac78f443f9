"""What ends an environment's episode early, told one way: the :class:`Score` its sample
gets (reward 0, an error tag and a detail), a count in the episodes' ``stats``, and a
warning for the first few of each kind, so a broken environment shows in the log
without flooding it. The driver that meets these failures is
:mod:`asyncrl.generators.episodes`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from asyncrl.generation.envs.threads import StepPool
from asyncrl.generation.rewards import Score

log = logging.getLogger("asyncrl.episodes")

ERROR_ENVIRONMENT = "error:environment"
ERROR_ENVIRONMENT_TIMEOUT = "error:environment_timeout"
ERROR_PROMPT_TOO_LONG = "error:prompt_too_long"
EPISODE_ERRORS = (ERROR_ENVIRONMENT, ERROR_ENVIRONMENT_TIMEOUT, ERROR_PROMPT_TOO_LONG)
"""Errors that end an episode early (counted ``finish_error``); a reward error does not."""
LOGGED_PER_TAG = 5


class EpisodeFailures:
    """Scores, counts and logs the failures of one replica's episodes."""

    def __init__(self, stats: Counter[str], step_timeout_s: float):
        """``stats``: the episodes' counters, added to here."""
        self.stats = stats
        self.step_timeout_s = step_timeout_s
        self._logged: dict[str, int] = {}
        self._stall_logged = False

    def raised(self, name: str, what: str, error: BaseException) -> Score:
        """The environment's ``what`` (reset or step) raised ``error``."""
        self.stats["env_errors"] += 1
        self.warn(
            ERROR_ENVIRONMENT, "%s, scored 0: the environment's %s raised %r", name, what, error
        )
        detail = f"{type(error).__name__}: {error}"[:500]
        return Score(0.0, ERROR_ENVIRONMENT, detail)

    def prompt_too_long(self, name: str, formatter: str, prompt_len: int, limit: int) -> Score:
        """The environment's reset gave a prompt over ``data.max_prompt_tokens``."""
        self.stats["prompt_too_long"] += 1
        self.warn(
            ERROR_PROMPT_TOO_LONG,
            "%s, scored 0: its prompt (the environment's reset messages, tool "
            "listing included, rendered by the %s formatter) has %d tokens, more "
            "than data.max_prompt_tokens=%d, so it ends before its first turn. "
            "Raise data.max_prompt_tokens or shorten the prompt",
            name,
            formatter,
            prompt_len,
            limit,
        )
        detail = f"{prompt_len} prompt tokens > data.max_prompt_tokens={limit}"
        return Score(0.0, ERROR_PROMPT_TOO_LONG, detail)

    def timed_out(self, name: str, what: str, started: bool, pool: StepPool) -> Score:
        """A reset or step gave up on: it could not start (every thread stuck), or it ran
        past ``environment.step_timeout_s`` and its thread was abandoned (``started``)."""
        self.stats["env_timeouts"] += 1
        if not started:
            detail = (
                f"the {what} could not start: {pool.stuck} environment threads are stuck "
                f"past environment.step_timeout_s={self.step_timeout_s:g}"
            )
        else:
            self.stats["steps_abandoned"] += 1
            detail = (
                f"the {what} ran past environment.step_timeout_s="
                f"{self.step_timeout_s:g}; its thread was abandoned"
            )
        self.warn(ERROR_ENVIRONMENT_TIMEOUT, "%s, scored 0: %s", name, detail)
        if pool.stalled and not self._stall_logged:
            self._stall_logged = True
            log.error(
                "%d environment threads are stuck (environment.step_timeout_s=%g); no more "
                "are started, so episodes fail until some return. Fix the environment, or "
                "restart this generator to free them",
                pool.stuck,
                self.step_timeout_s,
            )
        return Score(0.0, ERROR_ENVIRONMENT_TIMEOUT, detail)

    def warn(self, tag: str, message: str, *args: Any) -> None:
        """Log the first few of each kind of failure; the rest are only counted."""
        count = self._logged[tag] = self._logged.get(tag, 0) + 1
        if count <= LOGGED_PER_TAG:
            log.warning(message, *args)
            if count == LOGGED_PER_TAG:
                log.warning("further %s failures are counted, not logged", tag)
