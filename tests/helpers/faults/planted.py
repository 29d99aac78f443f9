"""Faults planted in a user's code: a reward function file that hangs, exits or floods, and
``sitecustomize`` hooks on ``PYTHONPATH`` that slow one engine call or drop LoRA adapters.
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
from pathlib import Path

REWARD_FILE = '''
"""A user's reward function (digits) that misbehaves once per trigger file in TRIGGERS:
``hang`` sleeps for an hour, ``crash`` exits its process, ``flood`` prints 64 MiB."""
import os
import sys
import time

from asyncrl.generation.tasks import digits_score

TRIGGERS = {triggers!r}
FLOOD_MB = 64


def claim(name):
    """True for the one caller that takes the trigger ``name`` (and note when)."""
    try:
        os.rename(os.path.join(TRIGGERS, name), os.path.join(TRIGGERS, name + ".taken"))
    except FileNotFoundError:
        return False
    with open(os.path.join(TRIGGERS, name + ".at"), "w") as record:
        record.write(repr(time.time()))
    return True


def score(data_source, solution_str, ground_truth, extra_info=None):
    if claim("hang"):
        time.sleep(3600)
    if claim("crash"):
        os._exit(3)
    if claim("flood"):
        line = "flood " * 170 + "\\n"
        for _ in range(FLOOD_MB * 1024):
            sys.stdout.write(line)
        sys.stdout.flush()
    return digits_score(data_source, solution_str, ground_truth, extra_info)
'''


def reward_file(directory: Path) -> tuple[Path, Path]:
    """A reward function file and its trigger directory (see :data:`REWARD_FILE`)."""
    triggers = directory / "triggers"
    triggers.mkdir(parents=True, exist_ok=True)
    path = directory / "misbehaving_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE.format(triggers=str(triggers))))
    return path, triggers


def arm(triggers: Path, name: str) -> None:
    (triggers / name).touch()


def claimed_at(triggers: Path, name: str) -> float | None:
    """When a reward worker took the trigger ``name`` (``time.time()``), None before."""
    path = triggers / f"{name}.at"
    with contextlib.suppress(OSError, ValueError):
        return float(path.read_text())
    return None


HF_BACKEND_HOOK = '''

import importlib.abc
import importlib.util
import sys


class _Patch(importlib.abc.MetaPathFinder):
    """Calls the site's ``patch(HFBackend)`` as soon as the HF backend's module is loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "asyncrl.generators.hf_backend":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module.HFBackend)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(TRIGGER_VARIABLE):
    sys.meta_path.insert(0, _Patch())
'''


def plant_site(directory: Path, site: str, trigger_variable: str) -> str:
    """Write ``site`` (its ``patch(HFBackend)``, then :data:`HF_BACKEND_HOOK`) as the
    ``sitecustomize`` of ``directory/site``, active where ``trigger_variable`` is set;
    returns the ``PYTHONPATH`` that plants it in every process of a launch."""
    folder = directory / "site"
    folder.mkdir(parents=True, exist_ok=True)
    hook = HF_BACKEND_HOOK.replace("TRIGGER_VARIABLE", repr(trigger_variable))
    (folder / "sitecustomize.py").write_text(site + hook)
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


SLOW_CHUNK_SITE = '''
"""Planted by tests/helpers/faults/planted.py: one engine call of one generator sleeps
ASYNCRL_FAULT_SLOW_CHUNK_S seconds once the file ASYNCRL_FAULT_SLOW_CHUNK exists."""
import json
import os
import time


def _slowed(generate_chunk):
    trigger = os.environ["ASYNCRL_FAULT_SLOW_CHUNK"]
    seconds = float(os.environ["ASYNCRL_FAULT_SLOW_CHUNK_S"])

    def generate_chunk_slowly(self, rollouts, max_tokens):
        try:
            os.rename(trigger, trigger + ".taken")
        except FileNotFoundError:
            return generate_chunk(self, rollouts, max_tokens)
        began = time.time()
        time.sleep(seconds)
        result = generate_chunk(self, rollouts, max_tokens)
        record = {"pid": os.getpid(), "began": began, "ended": time.time()}
        with open(trigger + ".json", "w") as out:
            json.dump(record, out)
        return result

    return generate_chunk_slowly


def patch(backend):
    backend.generate_chunk = _slowed(backend.generate_chunk)
'''


def slow_chunk_env(directory: Path, seconds: float) -> tuple[dict[str, str], Path]:
    """The environment that plants a slow chunk (see :data:`SLOW_CHUNK_SITE`) and the
    trigger file to create when it should happen; ``TRIGGER.json`` records it."""
    trigger = directory / "slow-chunk"
    env = {
        "PYTHONPATH": plant_site(directory, SLOW_CHUNK_SITE, "ASYNCRL_FAULT_SLOW_CHUNK"),
        "ASYNCRL_FAULT_SLOW_CHUNK": str(trigger),
        "ASYNCRL_FAULT_SLOW_CHUNK_S": str(seconds),
    }
    return env, trigger


def slow_chunk_record(trigger: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(f"{trigger}.json").read_text())
    return None


KEEP_BASE_SITE = '''
"""Planted by tests/helpers/faults/planted.py: the first generator to load LoRA adapters
once the file ASYNCRL_FAULT_KEEP_BASE exists never applies any: it drops every version's
adapters and says it loaded them (its engine keeps the base model)."""
import os

broken = []


def _claimed():
    if not broken:
        trigger = os.environ["ASYNCRL_FAULT_KEEP_BASE"]
        try:
            os.rename(trigger, trigger + ".taken")
            broken.append(os.getpid())
        except FileNotFoundError:
            broken.append(None)
    return broken[0] is not None


def _dropping(load_in_parts):
    def load_weights_in_parts(self, names, parts, version):
        if self.adapter_digest is None or not _claimed():
            return load_in_parts(self, names, parts, version)
        for _ in parts:
            pass
        self.version = version  # and the adapter digest, read back, stays the base's

    return load_weights_in_parts


def patch(backend):
    backend.load_weights_in_parts = _dropping(backend.load_weights_in_parts)
    backend.weight_buffers = lambda self, buckets: None  # every path loads in parts
'''


def keep_base_env(directory: Path) -> tuple[dict[str, str], Path]:
    """The environment that plants a replica keeping the base model (see
    :data:`KEEP_BASE_SITE`), and the trigger file; ``TRIGGER.taken`` once one took it."""
    path = plant_site(directory, KEEP_BASE_SITE, "ASYNCRL_FAULT_KEEP_BASE")
    trigger = directory / "keep-base"
    trigger.touch()
    return {"PYTHONPATH": path, "ASYNCRL_FAULT_KEEP_BASE": str(trigger)}, trigger
