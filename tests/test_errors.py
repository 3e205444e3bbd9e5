"""Bad input gets an OpenAI-style error with the right status, and the server keeps serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import FP16_QUEUE

GOOD = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"]
    return err


@pytest.mark.parametrize("patch, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [-5, 3]}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logprobs": 1}, "logprobs"),
])
def test_invalid_completion_fields_are_400(server, patch, param):
    err = error_of(server.post("/v1/completions", json={**GOOD, **patch}), 400)
    assert err["type"] == "invalid_request_error"
    assert param in (err["param"] or "") or param in err["message"]


def test_missing_prompt_is_400(server):
    body = dict(GOOD)
    del body["prompt"]
    assert "prompt" in error_of(server.post("/v1/completions", json=body), 400)["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null"])
def test_malformed_body_is_400(server, raw):
    resp = server.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"})
    error_of(resp, 400)


def test_unknown_model_is_404(server):
    err = error_of(server.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_unknown_mode_is_400(server):
    err = error_of(server.post("/v1/completions", json={**GOOD, "mode": "warp-drive"}), 400)
    assert err["param"] == "mode" and "warp-drive" in err["message"]


def test_pinning_an_unavailable_mode_is_refused_not_rerouted(server):
    err = error_of(server.post("/v1/completions", json={**GOOD, "mode": "speculative_draft_model"}), 400)
    assert err["code"] == "mode_unavailable" and "unavailable" in err["message"]


def test_huge_max_tokens_and_long_prompts_exceed_the_context(server):
    err = error_of(server.post("/v1/completions", json={**GOOD, "max_tokens": 10**9}), 400)
    assert err["code"] == "context_length_exceeded"
    long_prompt = "word " * 9000  # the demo model's context is 8192 tokens
    err = error_of(server.post("/v1/completions", json={**GOOD, "prompt": long_prompt}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_chat_errors(server):
    error_of(server.post("/v1/chat/completions", json={"messages": []}), 400)
    error_of(server.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]}), 400)
    error_of(server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}), 400)
    error_of(server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "model": "nope"}), 404)


def test_oversized_body_is_413(server):
    resp = server.post("/v1/completions", data=b"x" * (5 * 2**20), headers={"Content-Type": "application/json"})
    error_of(resp, 413)


def test_unknown_route_and_method(server):
    error_of(server.get("/v1/nothing"), 404)
    error_of(server.get("/v1/completions"), 405)


def test_saturated_mode_answers_503_with_retry_after_and_loses_nothing(server):
    """The test server's fp16 queue holds FP16_QUEUE requests; a burst beyond it is refused, not dropped."""
    n = FP16_QUEUE + 4
    with ThreadPoolExecutor(n) as pool:
        resps = list(pool.map(lambda _: requests.post(server.url + "/v1/completions", timeout=300, json={
            **GOOD, "mode": "fp16", "max_tokens": 48, "prompt": "Count to fifty: one, two,"}), range(n)))
    ok = [r for r in resps if r.status_code == 200]
    busy = [r for r in resps if r.status_code == 503]
    assert len(ok) + len(busy) == n
    assert ok and busy
    for r in busy:
        assert r.headers["Retry-After"].isdigit()
        assert r.json()["error"]["code"] == "overloaded"
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 48
    assert server.get("/health").status_code == 200  # and the server carries on
    assert server.complete("Hello", max_tokens=2, mode="fp16")["modeswitch"]["mode"] == "fp16"
