"""Starting the vLLM engines: all at once, or staged (the first mode's engine alone, then the others behind the
requests it serves, under SCHED_IDLE), with progress lines against each engine's last start; and a first engine
that started eager because its compiled graphs were not built here yet, compiled behind the requests served.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

import psutil

from ...config import LoadConfig
from ...engines.vllm import plugin as vllm_plugin
from ...engines.vllm.args import quiet_environment
from ...engines.vllm.engine import VllmRunner
from ...memory import MemoryPlan
from ...priority import BackgroundStarts
from ...weights.presets import cache_dir
from ..base import Progress
from ..starts import StartHistory
from .layout import EngineLayout

#: how often a start reports the engines still starting
PROGRESS_S = 30.0

log = logging.getLogger(__name__)


def launch(key: str, args: dict[str, Any], background: BackgroundStarts | None = None) -> VllmRunner:
    """Start engine ``key``; under ``background`` its processes start under SCHED_IDLE and return to the normal
    policy once it is up."""
    if background is None:
        return VllmRunner(key, args)
    with background.lowered() as pids:
        runner = VllmRunner(key, args)
        pids += runner.pids
    return runner


class Swappable(Protocol):
    """A served engine whose runner a compiled one replaces (``.served.ServedEngine``)."""

    runner: VllmRunner

    def serve_from(self, runner: VllmRunner) -> None: ...


class EngineStarts:
    """Every engine's first start: the futures the backend's builds wait on, each start's time, the history."""

    def __init__(self, layout: EngineLayout, load: LoadConfig, closing: threading.Event,
                 serving: Callable[[str], Swappable | None]) -> None:
        """``serving(key)``: engine ``key`` as served while it is up (None while it is down or not built yet)."""
        self.layout = layout
        #: vLLM's own default, on a CPU too: its engines compile the model (Inductor; CUDA graphs on a GPU)
        #: unless ``--decode eager``. Compiled engines serve faster and start slower, Inductor's cache warm or
        #: not (``make setup`` warms it)
        self.compiled = load.decode != "eager"
        self.staged = load.staged
        self.yield_start_s = load.yield_start_s
        self.closing = closing
        self.serving = serving
        self.starting: dict[str, Future[VllmRunner]] = {}
        #: seconds each engine's first start took
        self.start_s: dict[str, float] = {}
        #: each engine's last start time (by engine, model and decode path), and when the current one began
        self.history = StartHistory(cache_dir() / "engine_starts.json")
        self._began: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        #: a staged start's later engines, started under SCHED_IDLE while the first one serves (see priority)
        self._background: BackgroundStarts | None = None
        self._plan: MemoryPlan | None = None
        #: a staged start's first engine when its compiled graphs were not built here yet: it serves eager, and
        #: is started again compiled once every engine is up (see _compile_behind)
        self._eager_first: str | None = None
        self._settled = 0  # engines whose first start has ended, either way
        self._settle_lock = threading.Lock()

    def runner(self, key: str, plan: MemoryPlan, progress: Progress) -> VllmRunner:
        """Engine ``key`` once it is up, its start begun here if it has not been: a staged start has the first
        mode's engine start alone (engines starting together share the CPU, and each takes several times as
        long as one alone), then every other engine together. Raises RuntimeError where it failed to start."""
        if key not in self.starting:
            first_of_staged = self.staged and not self.starting
            if first_of_staged and self.compiled and self.history.last(self._history_key(key, False)) is None:
                self._eager_first = key  # compiling first would cost minutes before the first answer
            self._start([key] if first_of_staged else [k for k in self.layout.engines(plan) if k not in self.starting],
                        plan, progress)
        if key in self._failed:  # its engine failed to start for an earlier mode: do not wait for it twice
            raise RuntimeError(self._failed[key])
        try:
            return self.starting[key].result()
        except Exception as exc:
            self._failed[key] = f"vLLM engine {key} failed to start: {exc}"
            raise RuntimeError(self._failed[key]) from exc

    def eager(self, key: str) -> bool:
        """Whether engine ``key`` starts eager: ``--decode eager``, or a staged start's first, not compiled here yet."""
        return not self.compiled or key == self._eager_first

    def _start(self, keys: list[str], plan: MemoryPlan, progress: Progress) -> None:
        """Start the engines ``keys`` at once, each on its own thread: most of an engine's start is its
        processes importing, loading and warming up one after another, so on a CPU four engines start in
        about the time of two. On a GPU they start one at a time, as vLLM's start-up memory check expects to
        see the device alone."""
        workers = len(keys) if self.layout.checkpoint.device.type == "cpu" else 1
        self._plan = plan
        quiet_environment(str(cache_dir()))
        os.environ.setdefault(vllm_plugin.ENV, "1")  # each engine's gloo groups on one device ("0": as torch ships)
        os.environ[vllm_plugin.SERVER_ENV] = str(os.getpid())  # its engines' processes leave when it is gone
        progress(f"starting {len(keys)} vLLM engine(s), {workers} at a time: " +
                 "; ".join(f"{key} for {', '.join(plan.users[key])}" for key in keys))
        if self.staged and self.yield_start_s > 0 and self.starting and self._background is None:
            self._background = BackgroundStarts(self.yield_start_s)  # the engines after the first
            if not self._background.enabled:
                progress("the engines starting in the background do not yield the CPU to the requests served: this "
                         "process runs under another policy than the normal one, or may not return from SCHED_IDLE")
        pool = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="vllm-start")
        for key in keys:
            self.starting[key] = pool.submit(self._start_engine, key, plan, progress, self._background)
        pool.shutdown(wait=False)
        if not any(t.name == "vllm-start-progress" and t.is_alive() for t in threading.enumerate()):
            threading.Thread(target=self._report_starting, args=(progress,), name="vllm-start-progress",
                             daemon=True).start()

    def _history_key(self, key: str, eager: bool) -> str:
        return f"{self.layout.checkpoint.preset.name}:{key}:{'eager' if eager else 'compiled'}"

    def _report_starting(self, progress: Progress) -> None:
        """Every :data:`PROGRESS_S` while engines start: each one's time so far, and its last start's."""
        while not self.closing.wait(PROGRESS_S):
            now = time.perf_counter()
            pending = [key for key, future in self.starting.items() if not future.done() and key in self._began]
            if not pending:
                return
            progress("vLLM engines starting: " + "; ".join(
                f"{key} {now - self._began[key]:.0f} s" + (f" (last start {last:.0f} s)"
                                                           if (last := self.history.last(
                                                               self._history_key(key, self.eager(key))))
                                                           else "")
                for key in pending))

    def _start_engine(self, key: str, plan: MemoryPlan, progress: Progress,
                      background: BackgroundStarts | None) -> VllmRunner:
        try:
            return self._start_runner(key, plan, progress, background)
        finally:
            self._settle(progress)

    def _start_runner(self, key: str, plan: MemoryPlan, progress: Progress,
                      background: BackgroundStarts | None) -> VllmRunner:
        modes, eager = plan.users[key], self.eager(key)
        self.layout.build_demo_checkpoints(key, plan, background is not None and background.enabled, progress)
        args = self.layout.args(key, plan, eager)
        started = self._began[key] = time.perf_counter()
        last = self.history.last(self._history_key(key, eager))
        progress(f"vLLM engine {key} starting for {', '.join(modes)}" +
                 (f" (its last start took {last:.0f} s)" if last else ""))
        runner = launch(key, args, background)
        self.start_s[key] = time.perf_counter() - started
        self.history.record(self._history_key(key, eager), self.start_s[key])
        lowered = " (started under SCHED_IDLE, behind the requests served)" if background and background.enabled else ""
        progress(f"vLLM engine {key} started in {self.start_s[key]:.0f} s{lowered}")
        return runner

    def _settle(self, progress: Progress) -> None:
        """One engine's first start has ended; once every planned engine's has, an eager first engine is
        compiled behind the requests served."""
        with self._settle_lock:
            self._settled += 1
            ready = self._eager_first is not None and self._plan is not None and \
                self._settled == len(self.layout.engines(self._plan))
        if ready and (served := self.serving(self._eager_first)) is not None:
            self.compile_behind(served, self._eager_first, progress,
                                "it started eager: its compiled graphs were not built here yet")

    def compile_behind(self, served: Swappable, key: str, progress: Progress, why: str) -> None:
        """On a thread of its own: start engine ``key`` again compiled (under SCHED_IDLE, as a staged start's
        later engines, unless ``--yield-start-s 0``), move its modes onto it, and stop the eager one once the
        requests on it are done.
        A first start that had no compiled graphs here fills Inductor's cache, so the next start compiles
        nothing; an engine that died comes back eager at once and is compiled again so (``.served``). Meanwhile
        the engine is held twice (its weights, KV and runtime)."""
        threading.Thread(target=self._compile_behind, args=(served, key, progress, why),
                         name=f"vllm-compile-behind-{key}", daemon=True).start()

    def _compile_behind(self, served: Swappable, key: str, progress: Progress, why: str) -> None:
        if self.closing.is_set():
            return
        old = served.runner
        progress(f"vLLM engine {key}: compiling it behind the requests served ({why})")
        started = time.perf_counter()
        args = {**old.engine_args, "enforce_eager": False}
        background = self._background  # a staged start's; after a restart, one of its own
        if background is None and self.yield_start_s > 0:
            background = BackgroundStarts(self.yield_start_s)
        try:
            new = launch(key, args, background)
        except Exception as exc:  # it keeps serving eager
            log.warning("vLLM engine %s: its compiled start failed (%s); it serves eager", key, exc)
            return
        self.history.record(self._history_key(key, False), time.perf_counter() - started)
        if self.closing.is_set() or self.serving(key) is not served or served.runner is not old:
            new.close()
            return
        served.serve_from(new)
        if key == self._eager_first:
            self._eager_first = None
        progress(f"vLLM engine {key}: compiled in {time.perf_counter() - started:.0f} s; its modes serve from it")
        while not old.idle() and not self.closing.wait(0.5):
            pass
        old.close()

    def stop_starting(self, owned: set[int], restarting: bool) -> None:
        """Kill the processes of engines still starting (a staged start's later engines, a restart when
        ``restarting``): a shutdown does not wait minutes for engines it will stop at once (their start fails as
        their processes go). They are this process's children that no started engine owns (``owned``)."""
        if all(f.done() for f in self.starting.values()) and not restarting:
            return
        for child in psutil.Process().children(recursive=True):
            if child.pid not in owned:
                try:
                    child.kill()
                except psutil.Error:
                    pass
