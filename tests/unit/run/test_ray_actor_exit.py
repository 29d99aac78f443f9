"""A role that fails inside a Ray actor ends the actor's process soon after, so the
driver learns of the failure from Ray even when the task's reply was lost (the actor's
host cut off from the driver while the role failed); a role stopped by SIGTERM does not."""

from __future__ import annotations

import os
import threading

import pytest

import asyncrl.run.roles
from asyncrl.run.ray import actors
from asyncrl.run.ray.actors import RoleActor, Stopped


@pytest.fixture
def exits(monkeypatch) -> tuple[list[int], threading.Event]:
    """The codes ``os._exit`` is called with, and an event set at the first call."""
    codes: list[int] = []
    called = threading.Event()

    def record(code: int) -> None:
        codes.append(code)
        called.set()

    monkeypatch.setattr(os, "_exit", record)
    monkeypatch.setattr(actors, "FAILED_EXIT_S", 0.01, raising=False)
    return codes, called


def role_main(error: BaseException):
    def main(argv: list[str]) -> None:
        raise error

    return main


def test_a_role_that_raised_ends_its_actor_s_process(monkeypatch, exits):
    codes, called = exits
    monkeypatch.setattr(asyncrl.run.roles, "main", role_main(RuntimeError("every path failed")))
    with pytest.raises(RuntimeError, match="every path failed"):  # the reply still carries it
        RoleActor().run(["generator", "/nonexistent"], {})
    assert called.wait(timeout=10)
    assert codes == [1]


def test_a_role_stopped_by_sigterm_leaves_its_actor_to_the_driver(monkeypatch, exits):
    codes, called = exits
    monkeypatch.setattr(asyncrl.run.roles, "main", role_main(Stopped()))
    RoleActor().run(["generator", "/nonexistent"], {})  # a clean stop: no error
    assert not called.wait(timeout=0.5)  # 50 times the exit delay
    assert codes == []
