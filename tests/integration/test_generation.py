"""Every mode the transformers engine serves, through real HTTP on the real demo model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "In 1969, the first humans",
    "The best way to learn a language is",
]
SHARED = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. However little known the feelings or views of such a man may be on his first entering "
          "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
          "considered the rightful property of some one or other of their daughters. ")
COPY_PROMPT = ("Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliett Kilo Lima Mike November. "
               "Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India Juliett Kilo Lima Mike November. "
               "Alpha Bravo Charlie Delta Echo")


def sse_events(resp) -> list:
    """Parse an SSE body into JSON payloads, checking the framing; the [DONE] marker must come last."""
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        events.append(block[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_returns_text_mode_and_reason(server):
    resp = server.post("/v1/completions", json={"model": "demo", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion"
    assert "Paris" in body["choices"][0]["text"]
    info = body["modeswitch"]
    assert info["mode"] in {m["name"] for m in server.get("/v1/modes").json()["modes"] if m["status"] == "available"}
    assert info["reason"].startswith("policy paper:")
    assert resp.headers["X-ModeSwitch-Mode"] == info["mode"]
    assert info["features"]["prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert info["features"]["prefix_cache_batched"] == 0  # the transformers prefix_cache: one at a time
    assert 0 < body["usage"]["completion_tokens"] <= 12


def test_chat_completion_uses_the_chat_template(server):
    resp = server.post("/v1/chat/completions", json={
        "model": "demo", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "system", "content": "You are a concise assistant."},
                     {"role": "user", "content": "What is the capital of France?"}]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]
    assert body["choices"][0]["finish_reason"] in {"stop", "length"}
    assert body["usage"]["prompt_tokens"] > 20  # the template wraps the two messages
    assert body["modeswitch"]["mode"]


def test_completion_stream_is_sse_and_matches_the_plain_response(server):
    plain = server.complete(PROMPTS[1], max_tokens=20, mode="fp16")["choices"][0]["text"]
    resp = server.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0,
                                                "mode": "fp16", "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    chunks = sse_events(resp)
    assert chunks[0]["modeswitch"]["mode"] == "fp16" == resp.headers["X-ModeSwitch-Mode"]
    assert chunks[0]["modeswitch"]["reason"] == "pinned by the request"
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) > 3  # really incremental


def test_chat_stream(server):
    resp = server.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16, "temperature": 0, "stream": True})
    chunks = sse_events(resp)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "mode" in chunks[0]["modeswitch"]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content.strip()
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}


@pytest.mark.parametrize("mode", ["fp16", "prefix_cache", "speculative", "continuous_batching"])
def test_pinned_mode_serves_the_request(server, mode):
    body = server.complete(PROMPTS[3], max_tokens=8, mode=mode)
    assert body["modeswitch"]["mode"] == mode
    assert body["modeswitch"]["reason"] == "pinned by the request"


def test_stop_string_ends_the_text(server):
    full = server.complete(PROMPTS[0], max_tokens=24, mode="fp16")["choices"][0]
    assert "." in full["text"]
    cut = server.complete(PROMPTS[0], max_tokens=24, mode="fp16", stop=["."])["choices"][0]
    assert cut["text"] == full["text"].split(".")[0]
    assert cut["finish_reason"] == "stop"


def test_prefix_cache_reuses_kv_and_matches_fp16(server):
    first = server.complete(SHARED + "Who is the man?", max_tokens=8, mode="prefix_cache")
    assert first["usage"]["prompt_tokens"] > 64
    prompt = SHARED + "What does he want?"
    again = server.complete(prompt, max_tokens=16, mode="prefix_cache")
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.8 * first["usage"]["prompt_tokens"] - 8, again["usage"]
    assert again["modeswitch"]["cached_tokens"] == cached
    reference = server.complete(prompt, max_tokens=16, mode="fp16")
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]
    # The controller sees the shared prefix and the paper policy's shared-prefix rule routes on it. Both
    # prefix-cache modes are candidates; the rule prefers the one whose store holds the prefix (fp16 KV here),
    # although gptq+prefix_cache is listed first.
    routed = server.complete(SHARED + "Where does he live?", max_tokens=4)
    info = routed["modeswitch"]
    held = info["features"]["prefix_match_by_mode"]
    assert info["features"]["prefix_match_tokens"] == held["prefix_cache"] >= 64
    assert held["gptq+prefix_cache"] < held["prefix_cache"]
    assert "shared-prefix" in info["reason"] and info["mode"] == "prefix_cache"
    assert routed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_continuous_batching_serves_8_concurrent_requests_like_sequential_fp16(server):
    expected = [server.complete(p, max_tokens=24, mode="fp16")["choices"][0]["text"] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: server.complete(p, max_tokens=24, mode="continuous_batching"), PROMPTS))
    assert [r["choices"][0]["text"] for r in results] == expected
    assert all(r["modeswitch"]["mode"] == "continuous_batching" for r in results)
    stats = {m["name"]: m for m in server.get("/v1/modes").json()["modes"]}["continuous_batching"]["stats"]
    assert stats["max_concurrent"] >= 4  # requests really shared the running batch


def test_speculative_equals_greedy_fp16_and_accepts_drafts(server):
    for prompt in (COPY_PROMPT, PROMPTS[2]):
        spec = server.complete(prompt, max_tokens=32, mode="speculative")
        fp16 = server.complete(prompt, max_tokens=32, mode="fp16")
        assert spec["choices"][0]["text"] == fp16["choices"][0]["text"]
        assert spec["usage"]["completion_tokens"] == fp16["usage"]["completion_tokens"]
    stats = spec["modeswitch"]["speculative"]
    copy = server.complete(COPY_PROMPT, max_tokens=32, mode="speculative")["modeswitch"]["speculative"]
    assert copy["accepted_draft_tokens"] > 0 and copy["target_steps"] < 32  # fewer target passes than tokens
    assert stats["target_steps"] >= 1
    modes = {m["name"]: m for m in server.get("/v1/modes").json()["modes"]}
    assert modes["speculative"]["draft"].startswith("ngram")
    assert modes["speculative"]["stats"]["spec_tokens_per_step"] > 1.0


def test_openai_client_talks_to_the_server(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].text
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Say hi"}],
                                          max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices).strip()


def test_all_modes_at_once_on_shared_weights_each_match_fp16(server):
    """The four served modes run concurrently on one copy of the weights; none disturbs another's output."""
    expected = {p: server.complete(p, max_tokens=16, mode="fp16")["choices"][0]["text"] for p in PROMPTS[:4]}
    jobs = [(p, m) for p in PROMPTS[:4] for m in ("prefix_cache", "speculative", "continuous_batching")]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: server.complete(job[0], max_tokens=16, mode=job[1]), jobs))
    for (prompt, mode), body in zip(jobs, results):
        assert body["modeswitch"]["mode"] == mode
        assert body["choices"][0]["text"] == expected[prompt], (mode, prompt)


def test_each_mode_card_says_what_its_linears_run(server):
    """Read from the loaded layers, not from the mode's name: the reference in the dtype asked for, LLM.int8's
    int8 rows, GPTQModel's 4-bit codes."""
    cards = {m["name"]: m for m in server.get("/v1/modes").json()["modes"] if m["status"] == "available"}
    reference = {"weights": "float32", "weight_format": "dense", "activations": "float32", "compute": "float32",
                 "kernel": "torch.nn.functional.linear"}
    assert all(cards[m]["kernels"] == {**reference, "engine": f"transformers:{m}"}
               for m in ("fp16", "prefix_cache", "speculative")), cards["fp16"]
    # a speculative generate() worker computes every prompt whole (from a stored cache it decodes other tokens)
    assert cards["speculative"]["prefix_cache"] is False and cards["speculative"]["prefix_cache_off"]
    int8, gptq = cards["int8"]["kernels"], cards["gptq"]["kernels"]
    assert (int8["weights"], int8["weight_format"], int8["kernel"]) == ("int8", "bitsandbytes LLM.int8",
                                                                        "bitsandbytes int8 matmul")
    assert (gptq["weights"], gptq["weight_format"]) == ("int4", "gptq 4-bit, group 64") and "GPTQModel" in gptq["kernel"]
