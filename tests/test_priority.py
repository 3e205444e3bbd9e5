"""Background starts under SCHED_IDLE (modeswitch.priority): what a staged start's later engines run under
while the first one serves. Real processes and real scheduling policies; skipped where Linux would not let
a thread return from SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20), where the server lowers nothing. The
vLLM backend's staged start is tested with a sleeper process standing in for each engine (the real engines'
start is what benchmarks/staged_start.py measures)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from modeswitch.engines.vllm_plugin import engine_cpus
from modeswitch.priority import SCHED_IDLE, BackgroundStarts, can_lower_and_restore

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

    def __init__(self, name: str, engine_args: dict) -> None:
        self.proc = sleeper()
        self.pids = [self.proc.pid]
        self.engine_args, self.max_num_seqs = engine_args, 4
        self.kernels: dict = {}  # a sleeper runs no linears
        self.cpus = engine_cpus(engine_args)  # what a real runner's worker is bound to
        SleeperRunner.started[name] = os.sched_getscheduler(0), os.sched_getscheduler(self.proc.pid)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_a_staged_vllm_start_lowers_the_engines_after_the_first_until_each_is_up(monkeypatch):
    """The wiring in VllmBackend: the first engine starts at the normal policy (it will serve), the others under
    SCHED_IDLE, each with its processes back at the normal policy once it is up."""
    from modeswitch.backends import vllm
    from modeswitch.config import LoadConfig
    from modeswitch.memory import MemoryPlan
    from modeswitch.models import PRESETS
    from modeswitch.modes import load_modes

    monkeypatch.setattr(vllm, "VllmRunner", SleeperRunner)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the variables a start sets for its engines stay here
    SleeperRunner.started.clear()
    backend = vllm.VllmBackend(PRESETS["demo"], LoadConfig(engine="vllm", device="cpu", staged=True))
    backend.open(print)
    specs = [m for m in load_modes() if m.name in ("fp16", "speculative")]  # two engines on every CPU
    plan = MemoryPlan(budget=2**40, weights={})
    for spec in specs:
        plan.add(backend.footprint(spec))
    try:
        built = [backend.build(spec, plan, print) for spec in specs]
        assert SleeperRunner.started == {"fp16": (os.SCHED_OTHER, os.SCHED_OTHER),
                                         "fp16+ngram-draft": (SCHED_IDLE, SCHED_IDLE)}
        assert [os.sched_getscheduler(mode.engine.runner.proc.pid) for mode in built] == [os.SCHED_OTHER] * 2
        if len(os.sched_getaffinity(0)) > 1:  # each engine on its own CPUs, the first engine's first
            cpus = [mode.details["cpus"] for mode in built]
            assert cpus[0] != cpus[1] and cpus[0][0] == min(os.sched_getaffinity(0))
    finally:
        backend.close()
