"""The server process as an operator drives it (signals, draining, exit codes), over the fake backend so no
model loads: SIGTERM drains, SIGHUP reloads the policy and keeps the old one when the file is broken."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from modeswitch.serving.launcher import ROOT, SERVE_FAKE, start_server
from waiting import wait_for


@pytest.fixture
def fake_process(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("name: first\nrules: []\ndefault: [fp16]\n")
    proc, url, log = start_server(tmp_path, "--modes", "fp16,prefix_cache", "--policy", str(policy),
                                  "--gate-report", "none", "--fake-token-s", "0.05", entry=SERVE_FAKE, wait_s=60)
    yield proc, url, log, policy
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def policy_name(url: str) -> str:
    return requests.get(url + "/admin/policy", timeout=5).json()["name"]


def test_sigterm_drains_in_flight_requests_and_exits_0(fake_process):
    proc, url, log, _ = fake_process
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}  # 2 s at 0.05 s a token
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, url + "/v1/completions", json=body, timeout=60)
        wait_for(lambda: requests.get(url + "/health", timeout=5).json()["in_flight"], 10, every=0.02)
        proc.send_signal(signal.SIGTERM)
        # a thread the handler starts sets it
        wait_for(lambda: requests.get(url + "/health", timeout=5).json()["draining"], 10, every=0.02)
        refused = requests.post(url + "/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        done = pending.result()
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
    assert proc.wait(timeout=30) == 0
    assert "drained" in log.read_text()


def test_sighup_reloads_the_policy_file_and_keeps_the_old_one_when_broken(fake_process):
    proc, url, log, policy = fake_process
    policy.write_text("name: hup\nrules: []\ndefault: [prefix_cache]\nfallback: [fp16]\n")
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while policy_name(url) != "hup":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    resp = requests.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30).json()
    assert resp["modeswitch"]["mode"] == "prefix_cache"
    policy.write_text("name: hup2\nrules: [\n")  # invalid YAML
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "policy not changed" not in log.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert policy_name(url) == "hup"


def test_a_port_in_use_is_refused_before_anything_loads():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, *SERVE_FAKE, "--port", str(port), "--gate-report", "none"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "memory plan" not in proc.stderr  # the port was claimed first: no model was planned or loaded
