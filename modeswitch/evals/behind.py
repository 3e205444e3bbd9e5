"""A server scores its gate-pending modes itself, on the kernels that serve them, behind the requests.

A mode is pending when the shipped gate report has rows for it scored on other kernels only (another machine's
verdict, see :func:`modeswitch.controller.quality.judge_mode`). Once every mode is up, :class:`PendingScorer` runs
the gate's tasks on the pending modes and on the reference (every delta is paired with the reference scored on
the same kernels) through the server's own service: the engines that serve, as a pinned request reaches them.
It sends one request at a time, each only once no request has been in flight for :data:`QUIET_S` (steady traffic
pauses it; it goes on in the gaps), so a request waits at most for one scoring request (a prompt scored, or one
short generation) sent in such a gap. The run goes into the controller's cache directory under the report's file
name (:func:`~modeswitch.evals.gate.add_run`), where the next start on the same kernels finds it, and the report is
read again: the modes' verdicts replace ``pending``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

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


class PendingScorer:
    """Scores the pending modes of ``service`` once, in a thread of its own (:meth:`start`). ``idle_s``: seconds
    since the server last had a request in flight (``Admission.idle_s``: the HTTP requests, which the scorer's
    own do not pass through)."""

    def __init__(self, service: Service, idle_s: Callable[[], float], tasks=TASKS, limit: int | None = LIMIT,
                 quiet_s: float = QUIET_S, progress: Callable[[str], None] = log.info) -> None:
        self.service, self.idle_s, self.quiet_s = service, idle_s, quiet_s
        self.tasks, self.limit, self.progress = tuple(tasks), limit, progress
        self._stop = threading.Event()
        #: the longest one scoring request took, first token to last: the most a request arriving meanwhile
        #: waited for one
        self.longest_s = 0.0

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run_logged, name="gate-pending", daemon=True)
        thread.start()
        return thread

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
        """Wait for every mode to be up, score the pending ones and the reference, keep the run, reload the report;
        the run, or None when nothing was pending (or the scoring was stopped)."""
        from .adapter import ModeSwitchLM
        from .gate import add_run, score_modes

        registry, controller = self.service.registry, self.service.controller
        while registry.loading() and not self._stop.wait(POLL_S):
            pass
        pending = self.pending()
        cache = controller.quality_cache
        if not pending or cache is None or self._stop.is_set():
            return None
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
        scorer's own requests have finished before it asks)."""
        modes = self.service.registry.modes
        while self.idle_s() < self.quiet_s or any(state.in_flight for state in modes.values()):
            if self._stop.wait(POLL_S):
                raise RuntimeError("the server is stopping")
