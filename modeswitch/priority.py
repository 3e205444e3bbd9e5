"""Work that must not slow what is being served runs under Linux's ``SCHED_IDLE`` CPU policy.

A staged start serves from its first engine while the other engines start in the background. On a CPU with
few cores those starts (each engine importing torch and vLLM in two processes, loading, warming up with OpenMP
threads on the same cores) slow the first engine's requests several-fold for the minutes they take
(``benchmarks/staged_start.py`` measures it). Started under ``SCHED_IDLE`` an engine gets only CPU time the
serving leaves, and goes back to the normal policy once it is up, or when ``limit_s`` has passed (a start
must not wait forever behind a server that never idles).

Linux lets a thread leave ``SCHED_IDLE`` only with CAP_SYS_NICE or RLIMIT_NICE >= 20 (a plain user has
neither, nor has root in a container started with Docker's default capabilities): where it would refuse,
nothing is lowered. Processes started by a lowered thread inherit its policy, so lowering the thread that
starts an engine lowers the engine's processes from their first instruction.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

import psutil

SCHED_IDLE = getattr(os, "SCHED_IDLE", None)  # Linux only


def lower(tid: int = 0) -> None:
    """The thread ``tid`` (0: the calling thread; a process's pid: its main thread), and every thread and
    process it starts from now on, under ``SCHED_IDLE``."""
    os.sched_setscheduler(tid, SCHED_IDLE, os.sched_param(0))


def can_lower_and_restore() -> bool:
    """Whether this process runs under the normal policy and may return a thread to it after lowering it
    (tried on a throwaway thread)."""
    if SCHED_IDLE is None or os.sched_getscheduler(0) != os.SCHED_OTHER:
        return False
    restored: list[bool] = []

    def probe() -> None:
        try:
            lower()
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            restored.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="sched-probe")
    thread.start()
    thread.join()
    return bool(restored)


def restore(pids: Iterable[int], keep: Iterable[int] = ()) -> None:
    """Every ``SCHED_IDLE`` thread of the processes ``pids``, except the threads ``keep``, back under the
    normal policy."""
    keep = set(keep)
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # exited
            continue
        for tid in tids:
            if tid in keep:
                continue
            try:
                if os.sched_getscheduler(tid) == SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


def _descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


class BackgroundStarts:
    """Starts (of engines, in their own processes) that yield the CPU to serving until they are up.

    ``lowered()`` wraps one start on its thread; when it ends, that start's processes (``pids``, known only
    once it is up) and the threads it created here return to the normal policy. After ``limit_s`` everything
    lowered is restored at once."""

    def __init__(self, limit_s: float) -> None:
        self.enabled = can_lower_and_restore()
        self._existing = _descendants() if self.enabled else set()
        self._threads: set[int] = set()
        self._lock = threading.Lock()
        self._expired = False
        if self.enabled:
            timer = threading.Timer(limit_s, self.expire)
            timer.daemon = True
            timer.start()

    @contextmanager
    def lowered(self) -> Iterator[list[int]]:
        """Yield a list for the start to fill with its processes' pids."""
        pids: list[int] = []
        me = threading.get_native_id()
        with self._lock:
            lowering = self.enabled and not self._expired
            if lowering:
                self._threads.add(me)
                lower()
        try:
            yield pids
        finally:
            if lowering:
                with self._lock:
                    self._threads.discard(me)
                    # this thread, the threads it started here, and its processes; not other starts' threads
                    restore([os.getpid(), *pids], keep=self._threads)

    def expire(self) -> None:
        """Restore every thread still lowered and every process started since: the time to yield is over."""
        with self._lock:
            self._expired = True
            restore([os.getpid(), *(_descendants() - self._existing)])
