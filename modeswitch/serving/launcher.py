"""Start ``serve.py`` as a child process on a free loopback port and wait until it is healthy.

Used by the test suite's session fixture and by the benchmarks, so both measure the server exactly
as a user starts it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import requests

from ..priority import lower

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the server as a user starts it, and the same process over the fake backend (no model; tests)
SERVE = (str(ROOT / "serve.py"),)
SERVE_FAKE = ("-m", "modeswitch.testing")


@dataclass
class Launched:
    """A server process started by :func:`launch_server`, maybe not serving yet."""

    proc: subprocess.Popen
    url: str
    log_file: Path

    def wait_ready(self, wait_s: float = 600, all_modes: bool = True) -> None:
        """Return once /health answers 200 and, with ``all_modes`` (what a measurement of the modes needs), no
        mode is still loading (a staged start); raise with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_file.read_text()[-4000:]}")
            try:
                health = requests.get(self.url + "/health", timeout=2)
                if health.status_code == 200:
                    if all_modes:
                        wait_loaded(self.url, deadline - time.monotonic())
                    return
            except requests.RequestException:  # not listening yet, or the port answers something else while starting
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server not ready in {wait_s} s:\n{self.log_file.read_text()[-4000:]}")


def launch_server(log_dir: Path, *args: str, entry: tuple[str, ...] = SERVE, idle: bool = False,
                  env: Mapping[str, str] | None = None) -> Launched:
    """Run ``python ENTRY --port P *args`` in the background, its output to a log file in ``log_dir``; ``env``:
    variables set for it beside this process's.

    ``idle``: the server and every process it starts (engines) run under Linux's ``SCHED_IDLE`` policy, on CPU
    time nothing else wants (:mod:`modeswitch.priority`): a server started ahead of its use, as the test suite
    starts the vLLM server, then does not slow the work in the foreground."""
    port = free_port()
    log_file = Path(log_dir) / f"server-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, *entry, "--port", str(port), *args],
        cwd=ROOT, stdout=log_file.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
    )
    if idle:  # set from here, not in a preexec_fn (unsafe with threads): the child starts no thread this soon
        lower(proc.pid)
    return Launched(proc, f"http://127.0.0.1:{port}", log_file)


def start_server(log_dir: Path, *args: str, wait_s: float = 600, entry: tuple[str, ...] = SERVE,
                 all_modes: bool = True, env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, str, Path]:
    """:func:`launch_server`, then wait until it is ready (:meth:`Launched.wait_ready`); return (process, base
    URL, log file)."""
    launched = launch_server(log_dir, *args, entry=entry, env=env)
    launched.wait_ready(wait_s, all_modes)
    return launched.proc, launched.url, launched.log_file


def wait_stopped(proc: subprocess.Popen, wait_s: float = 60) -> None:
    """Wait for a terminated server to exit (a ModeSwitch server drains, then stops its engines); SIGKILL it if
    it has not in ``wait_s``."""
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_loaded(url: str, wait_s: float = 900) -> None:
    """Wait until a serving server has no mode left loading (``/health``'s ``modes_loading``: a staged start)."""
    deadline = time.monotonic() + wait_s
    while requests.get(url + "/health", timeout=10).json().get("modes_loading"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: modes still loading after {wait_s:.0f} s")
        time.sleep(0.5)


def wait_calibrated(url: str, wait_s: float = 900) -> None:
    """Wait until a server's engines have measured their costs (``/v1/modes``' ``costs.calibration`` done, or off:
    ``--no-calibrate``)."""
    deadline = time.monotonic() + wait_s
    while not requests.get(url + "/v1/modes", timeout=30).json()["costs"]["calibration"].startswith(("done", "off")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: costs still being measured after {wait_s:.0f} s")
        time.sleep(1)
