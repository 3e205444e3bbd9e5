"""Background starts under SCHED_IDLE (modeswitch.priority): what a staged start's later engines run under
while the first one serves. Real processes and real scheduling policies; skipped where Linux would not let
a thread return from SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE < 20), where the server lowers nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
