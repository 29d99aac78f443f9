"""Where the built-in modules a config may name went when the layers became packages.

A config written before the move names ``asyncrl.rewards:gsm8k_score`` or
``asyncrl.tasks:digits_score``; importing that fails, and the error should give the
new name instead of only "no module".
"""

from __future__ import annotations

MOVED = {
    "asyncrl.rewards": "asyncrl.generation.rewards",
    "asyncrl.envs": "asyncrl.generation.envs",
    "asyncrl.tasks": "asyncrl.generation.tasks",
    "asyncrl.data": "asyncrl.generation.data",
}
"""The old name of each module a plug-in spec may point into, and its name now."""


def moved_hint(module_name: str) -> str:
    """`` (asyncrl.rewards is asyncrl.generation.rewards now)`` for a moved module, else ""."""
    for old, new in MOVED.items():
        if module_name == old or module_name.startswith(f"{old}."):
            return f" ({old} is {new} now: write {new}{module_name[len(old):]})"
    return ""
