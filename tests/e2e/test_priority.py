"""Background starts under SCHED_IDLE (modeswitch.priority): what a staged start's later engines run under
while the first one serves. Real processes and real scheduling policies; skipped where Linux would not let
a thread return from SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20), where the server lowers nothing. The
vLLM backend's staged start is tested with a sleeper process standing in for each engine (the real engines'
start is what benchmarks/staged_start.py measures)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from modeswitch.backends.starts import StartHistory
from modeswitch.engines.vllm.plugin import engine_cpus
from modeswitch.priority import SCHED_IDLE, BackgroundStarts, can_lower_and_restore
from waiting import wait_for

pytestmark = pytest.mark.skipif(not can_lower_and_restore(), reason="this process may not leave SCHED_IDLE")


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_start_runs_its_processes_idle_until_it_is_up_then_everything_is_back_to_normal():
    starts = BackgroundStarts(limit_s=600)
    other, proc = sleeper(), None  # other: started outside any background start, never touched
    try:
        with starts.lowered() as pids:
            assert os.sched_getscheduler(0) == SCHED_IDLE
            proc = sleeper()  # an engine's process, started from the lowered thread: idle from its start
            pids.append(proc.pid)
            assert os.sched_getscheduler(proc.pid) == SCHED_IDLE
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        assert os.sched_getscheduler(other.pid) == os.SCHED_OTHER
    finally:
        for p in (other, proc):
            if p is not None:
                p.kill()
                p.wait()


def test_past_the_limit_every_lowered_start_competes_again_and_later_ones_are_not_lowered():
    starts = BackgroundStarts(limit_s=600)
    with starts.lowered():
        proc = sleeper()
        try:
            starts.expire()  # what the timer runs at limit_s: the start is still going
            assert os.sched_getscheduler(0) == os.SCHED_OTHER
            assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        finally:
            proc.kill()
            proc.wait()
    with starts.lowered():
        assert os.sched_getscheduler(0) == os.SCHED_OTHER


class SleeperRunner:
    """Stands in for vLLM's engine (``VllmRunner``) in a staged start: its engine process is a sleeper, and it
    records the policy its start ran under and the one its process got."""

    started: dict[str, tuple[int, int]] = {}
    #: every start: (engine, compiled or not)
    runs: list[tuple[str, bool]] = []

    def __init__(self, name: str, engine_args: dict) -> None:
        self.proc = sleeper()
        self.pids = [self.proc.pid]
        self.engine_args, self.max_num_seqs = engine_args, 4
        self.kernels: dict = {}  # a sleeper runs no linears
        self.energy = self.cost = None
        self.cpus = engine_cpus(engine_args)  # what a real runner's worker is bound to
        SleeperRunner.started.setdefault(name, (os.sched_getscheduler(0), os.sched_getscheduler(self.proc.pid)))
        SleeperRunner.runs.append((name, not engine_args["enforce_eager"]))

    def death(self) -> str | None:
        return None if self.proc.poll() is None else "exited"

    wedged = False

    def stalled(self, bound_s: float) -> str | None:
        return f"no step finished in {bound_s + 1:.0f} s (wedged)" if self.wedged else None

    def kill(self) -> None:
        self.proc.kill()

    def abandon(self, reason: str) -> None:
        self.close()

    def idle(self) -> bool:
        return True

    def describe(self) -> dict:
        return {"pids": self.pids}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def staged_backend(monkeypatch, history, **load):
    """The vLLM backend of a staged start of fp16 and int8 (two engines), with sleepers for
    engines and ``history`` for the start times it reads; ``load``: further ``LoadConfig`` fields."""
    from modeswitch.backends.vllm import backend as vllm, start
    from modeswitch.config import LoadConfig
    from modeswitch.memory import MemoryPlan
    from modeswitch.weights.presets import PRESETS
    from modeswitch.modes import load_modes

    monkeypatch.setattr(start, "VllmRunner", SleeperRunner)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the variables a start sets for its engines stay here
    SleeperRunner.started.clear()
    SleeperRunner.runs.clear()
    backend = vllm.VllmBackend(PRESETS["demo"], LoadConfig(backend="vllm", device="cpu", staged=True, **load))
    backend.starts.history = history
    backend.open(print)
    specs = [m for m in load_modes() if m.name in ("fp16", "int8")]
    plan = MemoryPlan(budget=2**40, weights={})
    for spec in specs:
        plan.add(backend.footprint(spec))
    return backend, specs, plan


def test_a_staged_vllm_start_lowers_the_engines_after_the_first_until_each_is_up(monkeypatch, tmp_path):
    """The wiring in VllmBackend: the first engine starts at the normal policy (it will serve), the others under
    SCHED_IDLE, each with its processes back at the normal policy once it is up."""
    history = StartHistory(tmp_path / "starts.json")
    history.record("demo:fp16:compiled", 60)  # compiled here before: it starts compiled at once
    backend, specs, plan = staged_backend(monkeypatch, history)
    try:
        built = [backend.build(spec, plan, print) for spec in specs]
        assert SleeperRunner.started == {"fp16": (os.SCHED_OTHER, os.SCHED_OTHER),
                                         "int8": (SCHED_IDLE, SCHED_IDLE)}
        assert [os.sched_getscheduler(mode.engine.runner.proc.pid) for mode in built] == [os.SCHED_OTHER] * 2
        if len(os.sched_getaffinity(0)) > 1:  # each engine on its own CPUs, the first engine's first
            cpus = [mode.details["cpus"] for mode in built]
            assert cpus[0] != cpus[1] and cpus[0][0] == min(os.sched_getaffinity(0))
        assert SleeperRunner.runs == [("fp16", True), ("int8", True)]
    finally:
        backend.close()


def test_a_first_engine_never_compiled_here_serves_eager_then_compiled_behind(monkeypatch, tmp_path):
    """Compiling the first engine would cost minutes before the first answer on a fresh machine: it starts
    eager, and once every engine is up it is started again compiled, under SCHED_IDLE, its modes move onto it,
    the eager one stops, and the next start compiles at once (Inductor's cache and the start history)."""
    history = StartHistory(tmp_path / "starts.json")
    backend, specs, plan = staged_backend(monkeypatch, history)
    try:
        fp16, _ = [backend.build(spec, plan, print) for spec in specs]
        eager = fp16.engine.runner
        deadline = time.monotonic() + 30
        while fp16.engine.runner is eager and time.monotonic() < deadline:
            time.sleep(0.1)
        assert SleeperRunner.runs == [("fp16", False), ("int8", True), ("fp16", True)]
        assert fp16.engine.runner is backend.engines["fp16"].runner and fp16.details["decode"] == "compiled"
        deadline = time.monotonic() + 10
        while eager.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eager.proc.poll() is not None  # its requests done, the eager engine is stopped
        assert history.last("demo:fp16:compiled") is not None and history.last("demo:fp16:eager") is not None
    finally:
        backend.close()


def test_a_wedged_engine_is_killed_and_started_again(monkeypatch, tmp_path):
    """An engine whose step runs past --engine-stall-s counts as dead: its process is killed, its modes leave
    the pool, and it is started again at once (the real engine's stall is a step that does not
    return: benchmarks/chaos.py stops one with SIGSTOP)."""
    history = StartHistory(tmp_path / "starts.json")
    history.record("demo:fp16:compiled", 60)
    backend, specs, plan = staged_backend(monkeypatch, history)
    try:
        fp16, _ = [backend.build(spec, plan, print) for spec in specs]
        wedged = fp16.engine.runner
        wedged.wedged = True
        deadline = time.monotonic() + 30
        while fp16.engine.runner is wedged and time.monotonic() < deadline:
            time.sleep(0.1)
        assert wedged.proc.poll() is not None  # killed
        assert fp16.engine.runner is backend.engines["fp16"].runner is not wedged
        record = backend.supervisor.restarts["fp16"]
        assert (record.deaths, record.restarts, record.parks) == (1, 1, 0)
        assert fp16.engine.supervision() == {"engine_deaths": 1, "engine_restarts": 1, "engine_parks": 0}
    finally:
        backend.close()


def test_a_dead_engine_comes_back_each_time_and_a_crash_loop_waits_its_backoff(monkeypatch, tmp_path):
    """The vLLM backend's restarts, on engines whose process is a sleeper killed for real: each death is followed by
    a start at once; the 3rd death within the window (more than 2) parks the engine, its mode ``unavailable`` with
    the reason and the next start, and it is started again once the backoff has passed."""
    history = StartHistory(tmp_path / "starts.json")
    history.record("demo:fp16:compiled", 60)
    backend, specs, plan = staged_backend(monkeypatch, history, crash_loop_deaths=2, crash_loop_window_s=600,
                                          crash_loop_backoff_s=3)
    try:
        fp16, _ = [backend.build(spec, plan, print) for spec in specs]
        health: list[tuple[str | None, bool]] = []
        fp16.engine.watch(lambda down, restarting: health.append((down, restarting)))

        def kill_and_wait(timeout: float) -> float:
            """Kill the engine and wait for it to serve again; then for the compiled start behind the eager one
            it came back as, so that the next kill finds the engine that serves (a kill racing that swap would
            end an engine already replaced)."""
            dead, runs = fp16.engine.runner, len(SleeperRunner.runs)
            dead.proc.kill()
            killed = time.monotonic()
            deadline = killed + timeout
            while fp16.engine.runner is dead and time.monotonic() < deadline:
                time.sleep(0.05)
            assert fp16.engine.runner is not dead, backend.describe()["fp16"]
            took = time.monotonic() - killed
            deadline = time.monotonic() + 10
            while fp16.engine.runner.engine_args["enforce_eager"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert SleeperRunner.runs[runs:] == [("fp16", False), ("fp16", True)]  # back eager, compiled behind
            return took

        for death in (1, 2):
            assert kill_and_wait(5) < 2  # found within SUPERVISE_S, started at once
            assert health[-2][1] and health[-1] == (None, False)
        assert backend.describe()["fp16"]["status"] == "up"
        dead = fp16.engine.runner
        dead.proc.kill()
        # parked, and its watchers told so (just after)
        wait_for(lambda: backend.describe()["fp16"]["status"] == "parked" and health[-1][0] is not None, 5)
        card = backend.describe()["fp16"]
        assert (card["status"], card["deaths"], card["restarts"], card["parks"]) == ("parked", 3, 2, 1)
        assert 0 < card["next_retry_s"] <= 3
        down, restarting = health[-1]
        assert not restarting and "crash loop: 3 deaths in 600 s (more than 2" in down and "in 3 s" in down
        assert kill_and_wait(10) >= 3 - 0.6  # not before its backoff (the kill above was seen within 0.5 s)
        assert backend.describe()["fp16"]["status"] == "up" and health[-1] == (None, False)
        assert fp16.engine.supervision() == {"engine_deaths": 3, "engine_restarts": 3, "engine_parks": 1}
    finally:
        backend.close()
