"""When a dead engine is started again: at once, every time, unless it is in a crash loop.

Faults come in bursts and over weeks, so a server that gives up on an engine after a fixed number of deaths loses
its modes until someone restarts it. Here every death is followed by a restart that begins the moment the death
is seen; only a crash loop (more than ``crash_loop_deaths`` deaths, failed starts included, within
``crash_loop_window_s``) parks the engine: its modes are ``unavailable`` with the reason and the time of the next
try, which comes after ``crash_loop_backoff_s``, doubling with each park in a row up to ``crash_loop_backoff_max_s``.
A parked engine that is started again and dies at once is parked again for longer (its deaths are still inside
the window); one that stays up until its deaths have left the window starts over at the first backoff.

One :class:`Restarts` per supervised engine, kept by the supervisor both backends use (``backends.supervision``);
``/v1/modes`` and ``/metrics`` read :meth:`Restarts.stats`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from ..config import LoadConfig


@dataclass(frozen=True)
class RestartPolicy:
    """What counts as a crash loop, and how long a parked engine waits (``LoadConfig``'s ``crash_loop_*``, whose
    defaults these are)."""

    deaths: int = LoadConfig.crash_loop_deaths
    window_s: float = LoadConfig.crash_loop_window_s
    backoff_s: float = LoadConfig.crash_loop_backoff_s
    backoff_max_s: float = LoadConfig.crash_loop_backoff_max_s

    @classmethod
    def of(cls, load: LoadConfig) -> "RestartPolicy":
        """The policy a :class:`~modeswitch.config.LoadConfig` sets."""
        return cls(load.crash_loop_deaths, load.crash_loop_window_s, load.crash_loop_backoff_s,
                   load.crash_loop_backoff_max_s)


class Restarts:
    """One engine's deaths, restarts and parks, and when it is to be started next (thread-safe: the supervisor
    records deaths, a restart thread records starts, and ``/metrics`` reads it)."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.deaths = 0
        self.restarts = 0
        self.parks = 0
        self._recent: deque[float] = deque()  # times of the deaths within the window
        self._parked_in_a_row = 0
        #: when the next start is due (``clock`` time), and why it waits; None: up, or starting now
        self.retry_at: float | None = None
        self.parked_reason: str | None = None
        self._lock = threading.Lock()

    def died(self, why: str) -> float:
        """Record a death (or a failed start); returns the seconds to wait before the next start: 0, or the
        backoff of a crash loop (then :attr:`parked_reason` says so)."""
        with self._lock:
            now = self.clock()
            self.deaths += 1
            self._recent.append(now)
            while self._recent and self._recent[0] <= now - self.policy.window_s:
                self._recent.popleft()
            if len(self._recent) <= self.policy.deaths:
                self._parked_in_a_row = 0
                self.retry_at, self.parked_reason = now, None
                return 0.0
            delay = min(self.policy.backoff_s * 2 ** self._parked_in_a_row, self.policy.backoff_max_s)
            self._parked_in_a_row += 1
            self.parks += 1
            self.retry_at = now + delay
            self.parked_reason = (f"crash loop: {len(self._recent)} deaths in {self.policy.window_s:g} s (more than "
                                  f"{self.policy.deaths}; last: {why}); started again in {delay:g} s")
            return delay

    def retrying(self) -> None:
        """A parked engine's backoff is over: it is being started now."""
        with self._lock:
            self.retry_at, self.parked_reason = self.clock(), None

    def down_reason(self, why: str) -> str:
        """What its modes show while it is down: ``why``, and the crash loop's backoff when it is parked."""
        parked = self.parked_reason
        return why if parked is None else f"{why}; {parked}"

    def started(self) -> None:
        """The engine serves again."""
        with self._lock:
            self.restarts += 1
            self.retry_at, self.parked_reason = None, None

    @property
    def parked(self) -> bool:
        return self.parked_reason is not None

    def next_retry_s(self) -> float | None:
        """Seconds until the next start is due (0: due or under way); None while the engine is up."""
        retry_at = self.retry_at
        return None if retry_at is None else max(0.0, retry_at - self.clock())

    def stats(self) -> dict[str, Any]:
        """What ``/v1/modes`` shows and ``/metrics`` exports per mode (and per vLLM engine)."""
        out: dict[str, Any] = {"engine_deaths": self.deaths, "engine_restarts": self.restarts,
                               "engine_parks": self.parks}
        if (left := self.next_retry_s()) is not None:
            out["engine_next_retry_s"] = round(left, 1)
        return out
