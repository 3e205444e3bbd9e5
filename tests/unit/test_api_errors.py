"""Bad input gets an OpenAI-style error with the right status, and the server keeps serving (in-process,
fake backend: the validation is the API's, whatever engine serves)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from modeswitch.testing.engine import Script

GOOD = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.get_data(as_text=True) if hasattr(resp, "get_data") else resp.text
    err = (resp.get_json() if hasattr(resp, "get_json") else resp.json())["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"]
    return err


@pytest.fixture
def app(make_app):
    return make_app(unavailable={"speculative": "no draft model for this preset"},
                    modes=("fp16", "prefix_cache", "continuous_batching", "speculative"), context_length=512)


@pytest.mark.parametrize("patch, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [-5, 3]}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logprobs": 1, "echo": True, "max_tokens": 2}, "body"),
    ({"best_of": 2}, "best_of"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
])
def test_invalid_completion_fields_are_400(app, patch, param):
    err = error_of(app.post("/v1/completions", json={**GOOD, **patch}), 400)
    assert err["type"] == "invalid_request_error"
    assert param in (err["param"] or "") or param in err["message"]


def test_missing_prompt_is_400(app):
    body = dict(GOOD)
    del body["prompt"]
    assert "prompt" in error_of(app.post("/v1/completions", json=body), 400)["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null"])
def test_malformed_body_is_400(app, raw):
    error_of(app.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}), 400)


def test_unknown_model_is_404(app):
    err = error_of(app.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_unknown_mode_is_400(app):
    err = error_of(app.post("/v1/completions", json={**GOOD, "mode": "warp-drive"}), 400)
    assert err["param"] == "mode" and "warp-drive" in err["message"]


def test_pinning_an_unavailable_mode_is_refused_not_rerouted(app):
    err = error_of(app.post("/v1/completions", json={**GOOD, "mode": "speculative"}), 400)
    assert err["code"] == "mode_unavailable" and "no draft model" in err["message"]


def test_huge_max_tokens_and_long_prompts_exceed_the_context(app):
    err = error_of(app.post("/v1/completions", json={**GOOD, "max_tokens": 10**9}), 400)
    assert err["code"] == "context_length_exceeded"
    err = error_of(app.post("/v1/completions", json={**GOOD, "prompt": "word " * 200}), 400)  # 1000 bytes > 512
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_chat_errors(app):
    error_of(app.post("/v1/chat/completions", json={"messages": []}), 400)
    error_of(app.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]}), 400)
    error_of(app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}), 400)
    error_of(app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "model": "nope"}), 404)


def test_oversized_body_is_413(app):
    error_of(app.post("/v1/completions", data=b"x" * (5 * 2**20), headers={"Content-Type": "application/json"}), 413)


def test_unknown_route_and_method(app):
    error_of(app.get("/v1/nothing"), 404)
    resp = app.get("/v1/completions")
    error_of(resp, 405)
    assert "POST" in resp.headers["Allow"]


def test_saturated_mode_answers_503_with_retry_after_and_loses_nothing(make_app):
    """fp16's queue holds 8 requests; a burst of 12 pinned to it while each takes ~0.5 s: the excess is
    refused with 503 + Retry-After, everything accepted is answered in full."""
    app = make_app(scripts={"fp16": Script(token_s=0.05)})
    url = app.serve()
    n = 12
    with ThreadPoolExecutor(n) as pool:
        resps = list(pool.map(lambda _: requests.post(url + "/v1/completions", timeout=60, json={
            **GOOD, "mode": "fp16", "max_tokens": 10}), range(n)))
    ok = [r for r in resps if r.status_code == 200]
    busy = [r for r in resps if r.status_code == 503]
    assert len(ok) + len(busy) == n and ok and busy
    for r in busy:
        assert r.headers["Retry-After"].isdigit() and r.json()["error"]["code"] == "overloaded"
    assert all(r.json()["usage"]["completion_tokens"] == 10 for r in ok)
    assert app.get("/health").status_code == 200  # and the server carries on
    assert app.complete(max_tokens=2, mode="fp16")["modeswitch"]["mode"] == "fp16"


def test_a_mode_found_full_at_submission_is_skipped_and_the_next_one_answers(make_app, monkeypatch):
    """A decision may count the requests in flight from an earlier reading (a failed attempt's retry decides on the
    request's first features), and the capacity gate then passes every mode: the mode whose queue filled since
    refuses the request, and the next mode of the policy's list answers it, the refusal in its attempts."""
    import dataclasses

    from modeswitch.engines.base import GenRequest
    from modeswitch.sampling_params import SamplingParams

    app = make_app(modes=("fp16", "prefix_cache"), policy="name: t\nrules: []\ndefault: [fp16, prefix_cache]\n",
                   scripts={"fp16": Script(token_s=0.5)})
    fp16 = app.service.registry.modes["fp16"].engine
    for _ in range(fp16.max_queue):  # past the router: fp16 full
        fp16.submit(GenRequest(prompt_ids=[104, 105], params=SamplingParams(max_tokens=4)))
    read = app.service.features
    monkeypatch.setattr(app.service, "features", lambda *a, **k: dataclasses.replace(
        read(*a, **k), queue_depth=0, in_flight_by_mode={}))  # as read before fp16 filled
    block = app.complete(max_tokens=2)["modeswitch"]
    assert block["mode"] == "prefix_cache"
    assert block["attempts"][0].startswith("fp16: ") and "in flight, limit" in block["attempts"][0]
