"""Shared fixtures.

``make_app``: the whole server (registry, controller, service, HTTP app) in-process over the fake backend of
:mod:`modeswitch.testing`: no model, each app built in milliseconds; tests talk to it through Flask's test
client, or over real HTTP on 127.0.0.1 (``App.serve``) when they need concurrency.

``server``: one real server (demo model, real HTTP on 127.0.0.1) for the whole session, for what only the
real engines can show. It runs from copies of modes/ and policies/paper.yaml in a temp directory, so tests
can edit the policy file without touching the repo.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from modeswitch.compose import Server as Assembled
from modeswitch.compose import build_app
from modeswitch.config import HttpConfig, LoadConfig, ServerConfig
from modeswitch.launcher import ROOT, start_server
from modeswitch.testing.backend import FakeBackend

FP16_QUEUE = 2  # the test server's fp16 queue bound, small enough to saturate
DEFAULT_FAKE_MODES = ("fp16", "prefix_cache", "continuous_batching")


@dataclass
class App:
    """An in-process server over the fake backend."""

    assembled: Assembled
    backend: FakeBackend
    policy_file: Path
    _servers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = self.assembled.app.test_client()

    @property
    def service(self):
        return self.assembled.service

    def post(self, path: str, **kwargs):
        return self.client.post(path, **kwargs)

    def get(self, path: str, **kwargs):
        return self.client.get(path, **kwargs)

    def complete(self, prompt="Hello", max_tokens: int = 8, **fields) -> dict:
        resp = self.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  **fields})
        assert resp.status_code == 200, resp.get_data(as_text=True)
        return resp.get_json()

    def modes(self, **kwargs) -> dict[str, dict]:
        return {m["name"]: m for m in self.get("/v1/modes", **kwargs).get_json()["modes"]}

    def serve(self) -> str:
        """The same app over real HTTP (waitress, as serve.py runs it) on a free loopback port."""
        from waitress import create_server

        server = create_server(self.assembled.app, host="127.0.0.1", port=0, threads=48)
        threading.Thread(target=server.run, daemon=True).start()
        self._servers.append(server)
        return f"http://127.0.0.1:{server.effective_port}"

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self.assembled.close()


@pytest.fixture
def make_app(tmp_path):
    """``make_app(modes=..., policy=YAML text, scripts={mode: Script}, unavailable={mode: reason}, **http)``;
    ``staged=True, held=(modes,)``: a staged start whose held modes load once ``app.backend.release`` is set."""
    made: list[App] = []

    def make(modes=DEFAULT_FAKE_MODES, policy: str | None = None, scripts=None, unavailable=None,
             context_length: int = 2048, modes_dirs=(), admin_dirs=(), staged: bool = False, held=(),
             **http) -> App:
        policy_file = tmp_path / "policies" / f"policy{len(made)}.yaml"
        policy_file.parent.mkdir(exist_ok=True)
        policy_file.write_text(policy or f"name: test\nrules: []\ndefault: [{modes[0]}]\n")
        config = ServerConfig(model="demo", modes=tuple(modes), modes_dirs=tuple(modes_dirs), policy=policy_file,
                              gate_report="none", admin_dirs=tuple(admin_dirs), http=HttpConfig(**http),
                              load=LoadConfig(staged=staged))
        backend = FakeBackend(scripts, unavailable, context_length, held=held)
        app = App(build_app(config, progress=lambda s: None, backend=backend), backend, policy_file)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


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
    proc, url, log_file = start_server(tmp, "--model", "demo", "--engine", "transformers", "--modes-dir", str(modes),
                                       "--modes-dir", str(extra), "--policy", str(policy), "--gate-report", "none")
    yield Server(url, proc, policy, log_file)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
