"""The learner's stop signal: SIGTERM or SIGINT asks for a stop at the next step boundary."""

from __future__ import annotations

import signal


class StopRequest:
    """Set by SIGTERM or SIGINT; the training loop stops at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def _request(self, *_) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested
