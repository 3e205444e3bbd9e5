"""A server scores its gate-pending modes itself, on the kernels that serve them, behind the requests.

A mode is pending when the shipped gate report has rows for it scored on other kernels only (another machine's
verdict, see :func:`modeswitch.controller.quality.judge_mode`). Once every mode is up, :class:`PendingScorer` runs
the gate's tasks on the pending modes and on the reference (every delta is paired with the reference scored on
the same kernels) through the server's own service: the engines that serve, as a pinned request reaches them.
It sends one request at a time, each once no request has been in flight for :data:`QUIET_S` (it goes on in the
gaps), so a request waits at most for one scoring request (a prompt scored, or one short generation) sent in such a
gap. Traffic that leaves no such gap slows it to :data:`BUSY_SHARE` of the time instead of stopping it: a machine
whose kernels no shipped run covers judges its quantized modes under steady traffic too, in a bounded time. The run
goes into the controller's cache directory under the report's file name (:func:`~modeswitch.evals.gate.add_run`),
where the next start on the same kernels finds it, and the report is read again: the modes' verdicts replace
``pending``.

:func:`score_behind` starts it for an assembled server, the single one (``server.py``) and each replica of a cluster
(``cluster/replica.py``) alike. Servers that share the cache (a cluster's replicas on one machine) score one at a
time, under a lock on the report's file: the next one reads the run the first kept and scores only what is still
pending on its own kernels, so a machine scores its kernels once, not once a replica.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import IO, Callable

from ..compose import Server
from ..serving.service import Service
from ..weight_kinds import REFERENCE_MODE
from .run import TASKS

log = logging.getLogger(__name__)

#: documents per task, as the shipped reports were scored
LIMIT = 100
#: how often the scorer looks whether the modes are up, and whether the server is quiet
POLL_S = 0.05
#: seconds without a request in flight before a scoring request is sent
QUIET_S = 2.0
#: how often a scorer waiting for another server's run on the shared cache tries its lock again
LOCK_POLL_S = 1.0
#: under traffic that leaves no quiet gap, the share of the time the scorer's requests (one at a time) may still
#: take: after a request it waits (1 - share) / share times as long as that request took, then sends the next
BUSY_SHARE = 0.1


class PendingScorer:
    """Scores the pending modes of ``service`` once, in a thread of its own (:meth:`start`). ``idle_s``: seconds
    since the server last had a request in flight (``Admission.idle_s``: the HTTP requests, which the scorer's
    own do not pass through)."""

    def __init__(self, service: Service, idle_s: Callable[[], float], tasks=TASKS, limit: int | None = LIMIT,
                 quiet_s: float = QUIET_S, progress: Callable[[str], None] = log.info,
                 busy_share: float = BUSY_SHARE) -> None:
        self.service, self.idle_s, self.quiet_s, self.busy_share = service, idle_s, quiet_s, busy_share
        #: when the last scoring request was sent (``time.monotonic()``; None before the first)
        self._sent_at: float | None = None
        self.tasks, self.limit, self.progress = tuple(tasks), limit, progress
        self._stop = threading.Event()
        #: the longest one scoring request took, first token to last: the most a request arriving meanwhile
        #: waited for one
        self.longest_s = 0.0
        self.thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self._run_logged, name="gate-pending", daemon=True)
        self.thread.start()
        return self.thread

    def stop(self) -> None:
        """Send no further scoring request (server shutdown)."""
        self._stop.set()

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception:  # the modes stay pending; serving goes on
            if not self._stop.is_set():
                log.exception("quality gate: scoring the pending modes failed; they stay pending")

    def pending(self) -> list[str]:
        """The resident modes whose quality verdict is pending now."""
        verdicts = self.service.controller.quality_verdicts() or {}
        return [name for name, judged in verdicts.items() if judged.status == "pending"]

    def run(self) -> dict | None:
        """Wait for every mode to be up, then for the report's lock (another server sharing the cache may be
        scoring), score what is still pending and the reference, keep the run, reload the report; the run, or None
        when nothing was pending (or another server's run covered it, or the scoring was stopped)."""
        registry, controller = self.service.registry, self.service.controller
        while registry.loading() and not self._stop.wait(POLL_S):
            pass
        cache = controller.quality_cache
        if not self.pending() or cache is None or self._stop.is_set():
            return None
        turn = self._take_turn(cache / f"{controller.quality_report_path.name}.lock")
        if turn is None:
            return None
        with turn:  # closing the file lets the next server sharing the cache go on
            controller.load_quality_report()  # with the run another server kept while this one waited
            pending = self.pending()
            if not pending:
                self.progress("quality gate: another server sharing the cache scored these kernels; its run is read")
                return None
            return self._score(pending, cache)

    def _take_turn(self, lock: Path) -> IO | None:
        """The open lock file, locked for this server alone; None if the server stopped while another held it."""
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = lock.open("a")
        for attempt in itertools.count():
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return handle
            except BlockingIOError:
                if not attempt:
                    self.progress(f"quality gate: another server sharing {lock.parent} is scoring; waiting for its run")
            if self._stop.wait(LOCK_POLL_S):
                handle.close()
                return None

    def _score(self, pending: list[str], cache: Path) -> dict | None:
        """Score ``pending`` and the reference through the service, keep the run in ``cache``, read the report again."""
        from .adapter import ModeSwitchLM
        from .gate import add_run, score_modes

        registry, controller = self.service.registry, self.service.controller
        self.progress(f"quality gate: scoring {', '.join(pending)} on this machine's kernels behind the requests "
                      f"({self.limit} documents a task, one request at a time)")
        names = [REFERENCE_MODE, *(m for m in pending if m != REFERENCE_MODE)]
        specs = [registry.modes[n].spec for n in names if n in registry.modes]
        started = time.perf_counter()
        opened: list[ModeSwitchLM] = []

        def open_lm(spec):
            opened.append(ModeSwitchLM(mode=spec.name, service=self.service, before_request=self.wait_quiet))
            return opened[-1]

        try:
            run = score_modes(self.service.model_name, specs, open_lm, self.tasks, self.limit,
                              controller.policy.quality, self.progress)
        finally:
            self.longest_s = max((lm.longest_s for lm in opened), default=0.0)
        if self._stop.is_set():
            return None
        path = add_run(cache / controller.quality_report_path.name, run)
        controller.load_quality_report()
        verdicts = controller.quality_verdicts() or {}
        self.progress(f"quality gate: scored here in {time.perf_counter() - started:.0f} s (the longest scoring "
                      f"request {self.longest_s:.2f} s), kept in {path}: "
                      + ", ".join(f"{m} {verdicts[m].status}" for m in pending if m in verdicts))
        return run

    def wait_quiet(self) -> None:
        """Return once the server has had no request in flight for :attr:`quiet_s` and no mode is busy (the
        scorer's own requests have finished before it asks); or, under traffic that leaves no such gap, once the
        scorer's requests would take no more than :attr:`busy_share` of the time: after waiting (1 - share) /
        share times as long as its last request took (the first: as if it took :attr:`quiet_s`)."""
        modes = self.service.registry.modes
        now = time.monotonic()
        took = now - self._sent_at if self._sent_at is not None else self.quiet_s
        busy_until = now + took * (1.0 - self.busy_share) / self.busy_share
        while ((self.idle_s() < self.quiet_s or any(state.in_flight for state in modes.values()))
               and time.monotonic() < busy_until):
            if self._stop.wait(POLL_S):
                raise RuntimeError("the server is stopping")
        self._sent_at = time.monotonic()


def score_behind(server: Server) -> PendingScorer | None:
    """Start scoring ``server``'s pending modes behind its HTTP requests; the scorer (to :meth:`~PendingScorer.stop`
    when the server shuts down), or None where nothing may be scored: ``--no-score-pending``, or a report given by
    path (enforced as it is: no cache to keep a run in). The idle signal is the server's admission, which every
    generation request through its Flask app takes a ticket from: a cluster replica runs that app on the requests
    forwarded to it, so they hold its scoring back as a single server's hold back its own."""
    if not server.config.score_pending or server.service.controller.quality_cache is None:
        return None
    scorer = PendingScorer(server.service, server.admission.idle_s)
    scorer.start()
    return scorer

