"""What every section shares: the strict base model, bounds, the error type, and the checks
of names and plug-in specs that several sections make."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MAX_TOKENS = 1 << 20
"""Upper bound of every token count: far above any model's context, far below an overflow."""
MAX_PROCESSES = 1024
"""Upper bound of replicas, ranks, workers and threads: more would only exhaust the machine."""


class Section(BaseModel):
    """Strict base: unknown keys are errors, not silently ignored; no float may be inf or nan
    (every float here is a rate, a coefficient, a size or a timeout)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ConfigError(ValueError):
    """Invalid configuration; ``str()`` gives one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [one_line(problem) for problem in problems]
        super().__init__("\n".join(self.problems))


def one_line(text: str) -> str:
    """A problem is one line of plain text, whatever a key or value in it holds."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


NAME_CHARACTERS = (
    "letters, marks and digits of any script (Unicode categories L, M, N), the space, and "
    "ASCII punctuation but / and \\"
)
"""What a name that becomes a path (``run.name``) may hold. Not control characters (NUL,
newline, U+0085), format characters (U+202E, which shows text right to left, zero-width
spaces), line or paragraph separators (U+2028) or other spaces: each makes a directory
whose name is not what a terminal or a log shows."""


def directory_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one directory's name, or None (see :data:`NAME_CHARACTERS`)."""
    if not name.strip():
        return "must not be empty: it names the run's directory"
    if "/" in name or "\\" in name or os.sep in name:
        return f"{name!r} holds a path separator: it names one directory, inside run.output_dir"
    if ".." in name:
        return f"{name!r} holds '..': it names one directory, inside run.output_dir"
    for character in name:
        if not _safe_in_a_name(character):
            return (
                f"{name!r} holds {_code_point(character)}, which a name that becomes a "
                f"directory may not: use {NAME_CHARACTERS}"
            )
    if name != name.strip(" "):
        return f"{name!r} starts or ends with a space: it names a directory"
    if len(name) > 100:
        return f"is {len(name)} characters long; at most 100 (it names a directory)"
    return None


def _safe_in_a_name(character: str) -> bool:
    if character.isascii():
        return character == " " or (character.isprintable() and not character.isspace())
    return unicodedata.category(character)[0] in "LMN"


def _code_point(character: str) -> str:
    """``U+202E (RIGHT-TO-LEFT OVERRIDE)``."""
    name = unicodedata.name(character, "")
    return f"U+{ord(character):04X}" + (f" ({name})" if name else "")


def spec_parts(spec: str) -> tuple[str, str] | None:
    """``(where, name)`` of a `module:name` or `path/to/file.py:name` spec, or None."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        return None
    return where, name


def spec_file(spec: str) -> Path | None:
    """The file a `path/to/file.py:name` spec names (as the loaders read it), or None for a
    module spec; see :func:`asyncrl.generation.rewards.load_reward_function`."""
    parts = spec_parts(spec)
    if parts is None:
        return None
    where = parts[0]
    if where.endswith(".py") or "/" in where or "\\" in where or os.sep in where:
        return Path(where).expanduser()
    return None


def shorten(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
