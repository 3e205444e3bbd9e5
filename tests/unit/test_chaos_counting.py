"""benchmarks/chaos.py counts every way a request can fail, against a real HTTP server on loopback that fails each
way (the requests library's own exceptions decide the outcome, which is where failures used to slip through: a
stream that stalls after its headers raises ConnectionError, not Timeout), and attributes requests to the replica
and engine that served or failed them."""

from __future__ import annotations

import importlib.util
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("chaos", Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py")
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)

TIMEOUT_S = 2.0  # a loaded 2-core machine may hold a thread of the fake server for most of a second


def event(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


HEAD = event({"choices": [], "modeswitch": {"mode": "int8"}})
#: what the server does with the next request, by name
BEHAVIOURS = {
    "ok": [HEAD, event({"choices": [{"delta": {"content": "hi"}}]}), event("[DONE]")],
    "error_event": [HEAD, event({"error": {"message": "vLLM engine int8 died: killed", "code": "mode_failed"}}),
                    event("[DONE]")],
    "truncated": [HEAD, event({"choices": [{"delta": {"content": "hi"}}]})],
    "stalled": [HEAD, "sleep"],
    "stranded": ["sleep-before-headers"],
    "hung": ["sleep-3-before-headers"],
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        steps = BEHAVIOURS[self.server.behaviour]
        if steps[0] == "sleep-before-headers":
            time.sleep(TIMEOUT_S * 2)
            return
        if steps[0] == "sleep-3-before-headers":
            time.sleep(3)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-ModeSwitch-Mode", "int8")
        self.send_header("X-ModeSwitch-Replica", "r1")
        self.end_headers()
        for step in steps:
            if step == "sleep":
                self.wfile.flush()
                time.sleep(TIMEOUT_S * 2)
                return
            if isinstance(step, bytes):
                self.wfile.write(step)
                self.wfile.flush()


@pytest.fixture(scope="module")
def failing_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def stream(failing_server, behaviour: str) -> dict:
    failing_server.behaviour = behaviour
    load = chaos.Load(f"http://127.0.0.1:{failing_server.server_address[1]}", 1, TIMEOUT_S, ["int8"])
    load.pending[0] = {}
    return load._one(0, "stream", random.Random(0))


@pytest.mark.parametrize("behaviour", ["ok", "error_event", "truncated", "stalled", "stranded"])
def test_each_way_a_stream_ends_is_its_own_outcome(failing_server, behaviour):
    record = stream(failing_server, behaviour)
    assert record["outcome"] == behaviour, record
    if behaviour != "stranded":  # answered: the replica and mode that served it are known
        assert (record["replica"], record["mode"]) == ("r1", "int8")


def test_a_client_hung_past_its_join_is_counted_once(failing_server):
    failing_server.behaviour = "hung"
    load = chaos.Load(f"http://127.0.0.1:{failing_server.server_address[1]}", 1, 10.0, ["int8"])
    load.threads[0].start()
    time.sleep(0.5)
    load.finish(join_s=0.2)
    assert [r["outcome"] for r in load.records] == ["hung"]
    load.threads[0].join(10)  # its request ends after all: still counted once
    assert [r["outcome"] for r in load.records] == ["hung"]


def test_every_failure_counts_in_the_summary():
    records = [{"kind": "stream", "outcome": o, "status": 200} for o in
               ("ok", "error_event", "truncated", "stalled", "stranded", "hung", "connection_error")]
    records += [{"kind": "plain", "outcome": "http_500 None", "status": 500},
                {"kind": "pinned", "outcome": "http_503 mode_failed", "status": 503},
                {"kind": "bad", "outcome": "http_400 None", "status": 400}]
    summary = chaos.summarize_outcomes(records)
    assert (summary["unanswered"], summary["truncated"], summary["connection_errors"]) == (3, 1, 1)
    assert summary["unexpected_5xx"] == 2  # the 500, and the error event sent inside a 200 stream
    assert sum(summary["outcomes"].values()) == len(records) == summary["requests"]
    assert summary["bad_requests_answered_400"] == summary["bad_requests"] == 1


def test_requests_are_attributed_to_the_replica_and_engine_that_served_or_failed_them():
    views = [{"replica": r, "modes": [{"name": "int8", "vllm_engine": "int8"}, {"name": "fp16", "vllm_engine": "fp16"},
                                      {"name": "prefix_cache", "vllm_engine": "fp16"}]} for r in ("r1", "r2")]
    placement = chaos.engine_of(views)
    assert placement[("r2", "prefix_cache")] == "r2/fp16"
    kill = {"engine": "r1/int8", "killed": 10.0}
    records = [
        {"start": 9, "end": 11, "outcome": "ok", "replica": "r1", "mode": "fp16", "failed_on": ["int8"]},  # retried
        {"start": 9, "end": 11, "outcome": "ok", "replica": "r2", "mode": "fp16", "failed_on": ["int8"]},  # other replica
        {"start": 9, "end": 11, "outcome": "error_event", "replica": "r1", "mode": "int8"},
        {"start": 9, "end": 11, "outcome": "http_503 mode_failed", "replica": None, "mode": "int8",
         "error": "vLLM engine int8 died: killed"},
        {"start": 11, "end": 12, "outcome": "truncated", "replica": "r1", "mode": "int8"},  # began after the kill
    ]
    assert chaos.attribute(records[0], placement) == ["r1/fp16", "r1/int8"]
    assert chaos.attribute(records[1], placement) == ["r2/fp16", "r2/int8"]
    assert chaos.on_kill(records, kill, placement) == {
        "error_event": 1, "http_503 mode_failed (replica not known)": 1, "retried": 1}
    one_server = chaos.engine_of([{"modes": views[0]["modes"]}])  # no replicas: engines by their key alone
    assert chaos.on_kill(records[3:4], {"engine": "int8", "killed": 10.0}, one_server) == {"http_503 mode_failed": 1}
