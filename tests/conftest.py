"""Shared fixtures: one real server (demo model, real HTTP on 127.0.0.1) for the whole test session.

The server runs from copies of modes/ and policies/paper.yaml in a temp directory, so tests can edit the
policy file (reload, SIGHUP) and give fp16 a small queue (saturation -> 503) without touching the repo.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from modeswitch.launcher import ROOT, start_server
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


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    modes = tmp / "modes"
    shutil.copytree(ROOT / "modes", modes)
    fp16 = modes / "fp16.yaml"
    fp16.write_text(fp16.read_text().replace("max_queue: 8", f"max_queue: {FP16_QUEUE}"))
    # The speculative variants, and one mode that cannot be served (the demo preset has no draft model).
    extra = tmp / "extra"
    shutil.copytree(ROOT / "modes" / "extra", extra)
    (extra / "speculative_draft_model.yaml").write_text(
        "name: speculative_draft_model\nweights: fp16\ndecoding: speculative\nspeculative: {draft: model}\n")
    policy = tmp / "policy.yaml"
    shutil.copy(ROOT / "policies" / "paper.yaml", policy)
    proc, url, log_file = start_server(tmp, "--model", "demo", "--modes-dir", str(modes), "--modes-dir", str(extra),
                                       "--policy", str(policy), "--gate-report", "none")
    yield Server(url, proc, policy, log_file)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
