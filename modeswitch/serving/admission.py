"""Admission control at the HTTP edge: per-client concurrency (429), draining on shutdown (503).

Every generation request takes a ticket before it reaches the controller and returns it when its
response has been sent (streams included). The counts make graceful shutdown exact: SIGTERM stops new
tickets, and the server exits once the last ticket is back.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Admission:
    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.draining = False
        self._by_client: dict[str, int] = defaultdict(int)
        self._active = 0
        self._last_left = time.monotonic()
        self._cond = threading.Condition()

    @property
    def active(self) -> int:
        return self._active

    def idle_s(self) -> float:
        """Seconds since the last admitted request was answered; 0 while one is in flight (what work behind the
        requests waits on, see ``modeswitch.evals.behind``)."""
        return 0.0 if self._active else time.monotonic() - self._last_left

    def enter(self, client: str) -> None:
        """Admit one request of ``client`` or raise :class:`Refused` (503 draining, 429 over the client's limit)."""
        with self._cond:
            if self.draining:
                raise Refused(503, "the server is shutting down", "shutting_down")
            if self.per_client and self._by_client[client] >= self.per_client:
                raise Refused(429, f"too many requests in flight for this client (limit {self.per_client})",
                              "rate_limit_exceeded")
            self._by_client[client] += 1
            self._active += 1

    def leave(self, client: str) -> None:
        with self._cond:
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]
            self._active -= 1
            self._last_left = time.monotonic()
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests, then wait for admitted ones to finish; True if all finished in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self.draining = True
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True
