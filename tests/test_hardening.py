"""Hardening: auth, a failing mode (retry + quarantine), bursts (429/503, nothing lost), dropped streams,
graceful shutdown. Every load here is bounded in count and time, on 127.0.0.1 only."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import ROOT
from modeswitch.launcher import start_server

KEY = "test-key-123"
RETRY_POLICY = "name: retry\nrules: []\ndefault: [fp16]\nfallback: [prefix_cache]\n"


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A small server with an API key, fp16 made to fail (test-only fault injection), a policy that falls
    back to prefix_cache, and a per-client limit of 3."""
    tmp = tmp_path_factory.mktemp("guarded")
    policy = tmp / "retry.yaml"
    policy.write_text(RETRY_POLICY)
    os.environ["MODESWITCH_INJECT_FAULTS"] = "fp16"
    try:
        proc, url, log = start_server(tmp, "--model", "demo", "--modes", "fp16,prefix_cache,continuous_batching",
                                      "--policy", str(policy), "--api-key", KEY, "--max-inflight-per-client", "3",
                                      "--gate-report", "none")
    finally:
        del os.environ["MODESWITCH_INJECT_FAULTS"]
    yield url
    stop(proc)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_needs_the_key(guarded):
    assert requests.get(guarded + "/health", timeout=10).status_code == 200
    for method, path in [("get", "/v1/models"), ("get", "/v1/modes"), ("get", "/admin/policy"),
                         ("post", "/admin/policy"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/openapi.json")]:
        for headers in ({}, auth("wrong"), {"Authorization": KEY}):
            resp = requests.request(method, guarded + path, headers=headers, json={}, timeout=10)
            assert resp.status_code == 401, (method, path, headers)
            assert resp.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(guarded + "/v1/models", headers=auth(), timeout=10).status_code == 200
    spec = requests.get(guarded + "/openapi.json", headers=auth(), timeout=10).json()
    assert spec["security"] == [{"bearer": []}]


def test_failing_mode_is_retried_elsewhere_then_quarantined(guarded):
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    first = requests.post(guarded + "/v1/completions", headers=auth(), json=body, timeout=120)
    assert first.status_code == 200, first.text
    info = first.json()["modeswitch"]
    assert info["mode"] == "prefix_cache" and first.headers["X-ModeSwitch-Mode"] == "prefix_cache"
    assert info["attempts"] == ["fp16: RuntimeError: injected fault"]
    assert "Paris" in first.json()["choices"][0]["text"]
    modes = {m["name"]: m for m in requests.get(guarded + "/v1/modes", headers=auth(), timeout=10).json()["modes"]}
    assert modes["fp16"]["status"] == "quarantined"
    assert modes["fp16"]["health"]["failures"] == 1 and modes["fp16"]["health"]["quarantine_left_s"] > 0
    # While quarantined, the controller skips fp16 up front (no failed attempt, the reason says why).
    second = requests.post(guarded + "/v1/completions", headers=auth(), json=body, timeout=120).json()
    assert second["modeswitch"]["mode"] == "prefix_cache" and "attempts" not in second["modeswitch"]
    assert "fp16: quarantined for" in second["modeswitch"]["reason"]
    # Pinned to the quarantined mode: 503 with Retry-After, never silently served elsewhere.
    pinned = requests.post(guarded + "/v1/completions", headers=auth(), json={**body, "mode": "fp16"}, timeout=60)
    assert pinned.status_code == 503 and pinned.headers["Retry-After"].isdigit()
    assert pinned.json()["error"]["code"] == "mode_quarantined"


def test_burst_of_10x_capacity_loses_nothing_and_health_stays_fast(guarded):
    """30 requests at once (10x the client's limit of 3): the excess gets 429, the rest full answers."""
    body = {"prompt": "Count: one, two,", "max_tokens": 12, "temperature": 0, "mode": "continuous_batching"}
    health_ms, stop_probe = [], threading.Event()

    def probe():
        while not stop_probe.is_set():
            t0 = time.perf_counter()
            assert requests.get(guarded + "/health", timeout=10).status_code == 200
            health_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    with ThreadPoolExecutor(30) as pool:
        resps = list(pool.map(lambda _: requests.post(guarded + "/v1/completions", headers=auth(), json=body,
                                                      timeout=120), range(30)))
    stop_probe.set()
    prober.join()
    ok = [r for r in resps if r.status_code == 200]
    limited = [r for r in resps if r.status_code == 429]
    assert len(ok) + len(limited) == 30 and 1 <= len(ok) and limited
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in ok)
    assert all(r.headers["Retry-After"].isdigit() and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in limited)
    assert requests.get(guarded + "/health", timeout=10).json()["in_flight"] == 0
    health_ms.sort()
    p99 = health_ms[min(len(health_ms) - 1, int(0.99 * len(health_ms)))]
    print(f"burst: sent 30, accepted {len(ok)}, rejected {len(limited)}, lost 0; /health p50 "
          f"{statistics.median(health_ms):.1f} ms p99 {p99:.1f} ms over {len(health_ms)} probes")
    assert p99 < 1000


def test_a_dropped_stream_cancels_its_generation_and_frees_its_slot(server):
    body = {"prompt": "Write a very long story about a dragon.", "max_tokens": 400, "temperature": 0,
            "mode": "prefix_cache", "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # the head chunk and a few tokens, then hang up
        assert any(b'"text"' in line for line in got)
    started = time.monotonic()
    while time.monotonic() - started < 10:  # 400 tokens would take ~20 s on 2 cores
        modes = {m["name"]: m for m in server.get("/v1/modes").json()["modes"]}
        if modes["prefix_cache"]["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert modes["prefix_cache"]["in_flight"] == 0
    assert server.get("/health").json()["in_flight"] == 0


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    proc, url, log = start_server(tmp_path, "--model", "demo", "--modes", "fp16", "--gate-report", "none")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(requests.post, url + "/v1/completions", json=body, timeout=120)
            deadline = time.monotonic() + 20
            while requests.get(url + "/health", timeout=5).json()["in_flight"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = requests.post(url + "/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            done = pending.result()
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=60) == 0
        assert "drained" in log.read_text()
    finally:
        stop(proc)
