"""Generators that went silent and came back: said in the log, counted, and timed.

A generator whose host loses its link stops heartbeating; after
``buffer.heartbeat_timeout_s`` its unfinished groups are handed out again. When
the link returns, the same process speaks again (ZeroMQ reconnects) and is
served new work; its samples of the requeued groups are refused as not handed
out to it. An operator sees both moments: the return, and the first sample
accepted after it, each with how long it took.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("asyncrl.buffer")


@dataclass
class Returns:
    """The generators expired for silence, until their first accepted sample after it."""

    silent_since: dict[str, float] = field(default_factory=dict)
    """Expired generator -> when it was last heard from before it went silent."""
    back_since: dict[str, float] = field(default_factory=dict)
    """Returned generator -> when it was heard from again; dropped at its first sample."""

    def expired(self, generator_id: str, last_seen: float) -> None:
        self.silent_since[generator_id] = last_seen
        self.back_since.pop(generator_id, None)

    def heard(self, generator_id: str, now: float) -> bool:
        """Any message from ``generator_id``: True when it had been expired (it is back)."""
        silent_since = self.silent_since.pop(generator_id, None)
        if silent_since is None:
            return False
        self.back_since[generator_id] = now
        log.warning(
            "generator %s is back after %.1fs of silence; its unfinished groups were "
            "handed out again, so it is served new ones",
            generator_id,
            now - silent_since,
        )
        return True

    def accepted(self, generator_id: str, now: float) -> None:
        """``generator_id``'s samples were accepted: the first since it came back is said."""
        back = self.back_since.pop(generator_id, None)
        if back is not None:
            log.info(
                "generator %s: first sample accepted since it came back, %.1fs after",
                generator_id,
                now - back,
            )

    def forget(self, generator_id: str) -> None:
        """``generator_id`` left or was replaced by a new process."""
        self.silent_since.pop(generator_id, None)
        self.back_since.pop(generator_id, None)
