"""Engine supervision, one shape for every engine family: find an engine that died or wedged, take it out of
the pool, answer what it held, and start it again (:mod:`.restarts` says when).

A watched engine (:class:`Supervised`) is whatever fails and comes back as one: a vLLM engine with every mode's
front on it (``backends.vllm``), or one transformers engine (``backends.transformers``). The supervisor
looks at each every :data:`~.base.SUPERVISE_S`; a fault is handled on its thread at once, and the engine is
started again on a thread of its own, since a vLLM engine takes seconds to start and the others must stay
watched meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from ..config import LoadConfig
from .base import SUPERVISE_S
from .restarts import RestartPolicy, Restarts

log = logging.getLogger(__name__)


class Supervised(Protocol):
    """An engine as its supervisor sees it."""

    #: how messages name it ("vLLM engine int8", "transformers engine fp16")
    label: str

    def fault(self, stall_s: float) -> str | None:
        """Why it cannot serve any more (it died, or a step has run past ``stall_s``), as its requests are told;
        None while it serves. Asked every :data:`~.base.SUPERVISE_S`, so cheap."""

    def abandon(self, reason: str) -> None:
        """Answer every request it holds with ``reason``; it takes no more until it is resumed."""

    def resume(self) -> bool:
        """Serve again: True once it does, False while it cannot yet (asked again a moment later). May take
        seconds; raises when a start failed (which counts as a death)."""

    def report_health(self, down: str | None, restarting: bool = False) -> None:
        """Tell the pool it is down (``down`` says why; ``restarting``: it is being started again) or up (None)."""


class Supervisor:
    """Watches a backend's engines by key, each with its :class:`~.restarts.Restarts` record."""

    def __init__(self, family: str, load: LoadConfig, closing: threading.Event | None = None) -> None:
        """``closing``: set when the backend stops; nothing is started again from then on."""
        self.family = family
        self.policy = RestartPolicy.of(load)
        self.stall_s = load.engine_stall_s
        self.closing = closing or threading.Event()
        #: each engine's deaths, restarts and next start (what ``/v1/modes`` and ``/metrics`` read)
        self.restarts: dict[str, Restarts] = {}
        self._watched: dict[str, Supervised] = {}
        self._down: set[str] = set()
        self._thread: threading.Thread | None = None

    def watch(self, key: str, engine: Supervised) -> Restarts:
        """Watch ``engine`` under ``key`` from now on; its record, for the engine's modes to show."""
        record = self.restarts.setdefault(key, Restarts(self.policy))
        self._watched[key] = engine
        if self._thread is None and not self.closing.is_set():
            self._thread = threading.Thread(target=self._run, name=f"{self.family}-supervisor", daemon=True)
            self._thread.start()
        return record

    def down(self, key: str) -> bool:
        return key in self._down

    def any_down(self) -> bool:
        """Whether an engine is down (being started again, or waiting out a crash loop's backoff)."""
        return bool(self._down)

    def status(self, key: str) -> str:
        """``up``, ``down`` (being started again) or ``parked`` (a crash loop's backoff)."""
        if key not in self._down:
            return "up"
        return "parked" if self.restarts[key].parked else "down"

    def close(self) -> None:
        self.closing.set()

    def _run(self) -> None:
        while not self.closing.wait(SUPERVISE_S):
            for key, engine in list(self._watched.items()):
                if key in self._down:
                    continue
                reason = engine.fault(self.stall_s)
                if reason is not None:
                    self._died(key, engine, reason)

    def _report_down(self, key: str, engine: Supervised, reason: str) -> None:
        record = self.restarts[key]
        engine.report_health(record.down_reason(reason), not record.parked)

    def _died(self, key: str, engine: Supervised, reason: str) -> None:
        """Out of the pool before its requests are answered (so that none is retried on it), then started again
        in the background: at once, or after a crash loop's backoff."""
        record = self.restarts[key]
        delay = record.died(reason)
        log.warning("%s; %d death(s), %d restart(s) so far", reason, record.deaths, record.restarts)
        self._down.add(key)
        self._report_down(key, engine, reason)
        engine.abandon(reason)
        threading.Thread(target=self._restart, args=(key, engine, delay), name=f"{self.family}-restart-{key}",
                         daemon=True).start()

    def _restart(self, key: str, engine: Supervised, delay: float) -> None:
        """Resume ``engine`` after ``delay`` seconds, then every :data:`~.base.SUPERVISE_S` until it serves; a
        start that fails counts as a death (so an engine that cannot start any more ends in a crash loop's
        backoff, and is tried again after it)."""
        record = self.restarts[key]
        while not self.closing.wait(delay):
            if record.parked:
                record.retrying()
                self._report_down(key, engine, f"{engine.label}: started again after a crash loop")
            try:
                if not engine.resume():
                    delay = SUPERVISE_S
                    continue
            except Exception as exc:
                reason = f"{engine.label} did not start again: {exc}"
                log.warning("%s", reason)
                delay = record.died(reason)
                self._report_down(key, engine, reason)
                continue
            record.started()
            self._down.discard(key)
            log.info("%s serves again (restart %d)", engine.label, record.restarts)
            engine.report_health(None)
            return
