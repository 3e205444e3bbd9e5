"""Shared fixtures: one real server (demo model, real HTTP on 127.0.0.1) for the whole test session.

The server runs from copies of modes/ and policies/paper.yaml in a temp directory, so tests can edit the
policy file (reload, SIGHUP) and give fp16 a small queue (saturation -> 503) without touching the repo.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
FP16_QUEUE = 2  # the test server's fp16 queue bound, small enough to saturate


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    policy_file: Path
    log_file: Path

    def post(self, path: str, **kwargs) -> requests.Response:
        kwargs.setdefault("timeout", 300)
        return requests.post(self.url + path, **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=30, **kwargs)

    def complete(self, prompt, max_tokens: int = 16, **fields) -> dict:
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
        resp = self.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def sighup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *extra: str, wait_s: float = 600) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log_file = tmp / f"server-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "serve.py"), "--port", str(port), *extra],
        cwd=ROOT, stdout=log_file.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_file.read_text()[-4000:]}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log_file
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not ready in {wait_s} s:\n{log_file.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    modes = tmp / "modes"
    shutil.copytree(ROOT / "modes", modes)
    fp16 = modes / "fp16.yaml"
    fp16.write_text(fp16.read_text().replace("max_queue: 8", f"max_queue: {FP16_QUEUE}"))
    policy = tmp / "policy.yaml"
    shutil.copy(ROOT / "policies" / "paper.yaml", policy)
    proc, url, log_file = start_server(tmp, "--model", "demo", "--modes-dir", str(modes), "--policy", str(policy))
    yield Server(url, proc, policy, log_file)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
