"""The serving path in-process over the fake backend: multi-prompt requests, retries and quarantine, bursts,
dropped streams, metrics, the learned policy on a slow mode. Bounded loads, 127.0.0.1 only."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client.parser import text_string_to_metric_families

from modeswitch.api.openapi import ModeList
from modeswitch.testing.engine import Script
from openai_checks import generating
from waiting import wait_for

RETRY_POLICY = "name: retry\nrules: []\ndefault: [fp16]\nfallback: [prefix_cache]\n"


def wait_idle(app, timeout: float = 5.0) -> dict:
    """/v1/modes once every mode's queue has drained (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        modes = app.modes()
        if all(m["in_flight"] == 0 for m in modes.values()) or time.monotonic() > deadline:
            return modes
        time.sleep(0.02)


def scrape(app) -> dict:
    samples = {}
    for family in text_string_to_metric_families(app.get("/metrics").get_data(as_text=True)):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_multi_prompt_request_with_a_bad_prompt_starts_nothing(make_app):
    app = make_app()
    resp = app.post("/v1/completions", json={"prompt": [[104, 105], [104, 105, 33], [1, 99999]], "max_tokens": 4})
    assert resp.status_code == 400 and resp.get_json()["error"]["param"] == "prompt"
    too_long = app.post("/v1/completions", json={"prompt": [[104, 105], [104] * 2040], "max_tokens": 16})
    assert too_long.status_code == 400 and too_long.get_json()["error"]["code"] == "context_length_exceeded"
    assert all(engine.submitted == 1 for engine in app.backend.engines.values())  # each mode's warm-up only


def test_a_multi_prompt_request_that_cannot_start_every_prompt_cancels_and_counts_the_others(make_app):
    """Short prompts go to fp16, long ones to prefix_cache, whose queue (one request) another request holds: the
    second prompt cannot start, and its own first prompt on fp16 would free nothing there: the answer is 503 at
    once and the first prompt's generation is cancelled and counted, not left running."""
    from modeswitch.sampling_params import SamplingParams

    policy = ("name: by-length\nrules:\n  - name: long\n    when: {prompt_tokens: {ge: 5}}\n    use: [prefix_cache]\n"
              "default: [fp16]\n")
    app = make_app(policy=policy, scripts={m: Script(token_s=0.05) for m in ("fp16", "prefix_cache")})
    app.service.registry.modes["prefix_cache"].engine.max_queue = 1
    other = app.service.start([104, 105, 106, 107, 108], SamplingParams(max_tokens=100), mode="prefix_cache")
    before, asked = scrape(app), time.monotonic()
    resp = app.post("/v1/completions", json={"prompt": [[104, 105], [104, 105, 106, 107, 108, 109]],
                                             "max_tokens": 100})
    assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "overloaded"
    assert time.monotonic() - asked < 2.5  # not after waiting out its first prompt (5 s)
    other.close()
    modes = wait_idle(app, timeout=2.0)  # 100 tokens would take 5 s: cancelled well before
    assert modes["fp16"]["in_flight"] == 0
    after = scrape(app)
    assert metric(after, "modeswitch_requests_total", mode="fp16", outcome="cancelled") - \
        metric(before, "modeswitch_requests_total", mode="fp16", outcome="cancelled") == 1


def test_a_request_of_more_prompts_than_the_queue_holds_is_served_whole(make_app):
    """fp16 takes one request at a time (max_queue 1): a request of three prompts pinned to it, and of two choices
    each, waits for its own earlier prompts to finish instead of refusing itself; every choice is answered in full
    and nothing is left in flight."""
    app = make_app(scripts={"fp16": Script(token_s=0.01)})
    app.service.registry.modes["fp16"].engine.max_queue = 1
    body = app.complete([[104, 105], [106, 107], [108, 109]], max_tokens=5, mode="fp16", n=2, seed=1)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"]["completion_tokens"] == 30
    assert wait_idle(app, timeout=2.0)["fp16"]["in_flight"] == 0
    # an engine that ends its requests as soon as they start: the counts a refusal was read on may be those of an
    # earlier prompt in the middle of ending, which the next decision no longer sees
    instant = make_app(scripts={"fp16": Script()})
    instant.service.registry.modes["fp16"].engine.max_queue = 1
    for _ in range(5):
        body = instant.complete([[104 + i % 20] for i in range(64)], max_tokens=2, mode="fp16")
        assert len(body["choices"]) == 64


def test_each_choice_of_a_multi_prompt_response_names_its_mode(make_app):
    policy = ("name: by-length\nrules:\n  - name: long\n    when: {prompt_tokens: {ge: 5}}\n    use: [prefix_cache]\n"
              "default: [fp16]\n")
    app = make_app(policy=policy)
    body = app.complete([[104, 105], [104, 105, 106, 107, 108, 109]], max_tokens=3)
    assert [c["modeswitch"]["mode"] for c in body["choices"]] == ["fp16", "prefix_cache"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    resp = app.post("/v1/completions", json={"prompt": [[104, 105], [104, 105, 106, 107, 108, 109]], "max_tokens": 3})
    assert resp.headers["X-ModeSwitch-Mode"] == "fp16,prefix_cache"


def test_a_staged_start_serves_from_the_policys_first_engine_while_the_others_load(make_app):
    policy = ("name: staged\nrules:\n  - name: long\n    when: {max_tokens: {ge: 50}}\n    use: [int8]\n"
              "default: [prefix_cache]\n")
    app = make_app(modes=("fp16", "prefix_cache", "int8"), policy=policy, staged=True, held=("int8",))
    health = app.get("/health")
    assert health.status_code == 200 and health.get_json()["modes_loading"] == 1
    listing = app.get("/v1/modes").get_json()
    ModeList.model_validate(listing)  # as published in /openapi.json
    assert {m["name"]: m["status"] for m in listing["modes"]} == \
        {"fp16": "available", "prefix_cache": "available", "int8": "loading"}
    long = app.complete("Hello", max_tokens=60)["modeswitch"]  # its rule's mode is loading: served all the same
    assert long["mode"] in ("fp16", "prefix_cache") and "while those load" in long["reason"]
    pinned = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "mode": "int8"})
    assert pinned.status_code == 503 and pinned.headers["Retry-After"].isdigit()
    assert pinned.get_json()["error"]["code"] == "mode_loading"
    app.backend.release.set()
    deadline = time.monotonic() + 5
    while app.get("/health").get_json()["modes_loading"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.complete("Hello", max_tokens=60)["modeswitch"]["mode"] == "int8"


def test_failing_mode_is_retried_elsewhere_then_quarantined(make_app):
    app = make_app(policy=RETRY_POLICY, scripts={"fp16": Script(fault=True)})
    first = app.complete("The capital of France is")
    assert first["modeswitch"]["mode"] == "prefix_cache"
    assert first["modeswitch"]["attempts"] == ["fp16: RuntimeError: injected fault"]
    modes = app.modes()
    assert modes["fp16"]["status"] == "quarantined"
    assert modes["fp16"]["health"]["failures"] == 1 and modes["fp16"]["health"]["quarantine_left_s"] > 0
    # While quarantined, the controller skips fp16 up front (no failed attempt, the reason says why).
    second = app.complete("The capital of France is")["modeswitch"]
    assert second["mode"] == "prefix_cache" and "attempts" not in second
    assert "fp16: quarantined for" in second["reason"]
    # Pinned to the quarantined mode: 503 with Retry-After, never silently served elsewhere.
    pinned = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "mode": "fp16"})
    assert pinned.status_code == 503 and pinned.headers["Retry-After"].isdigit()
    assert pinned.get_json()["error"]["code"] == "mode_quarantined"


def test_a_mode_failing_mid_answer_is_retried_unseen_unless_streaming(make_app):
    """An answer sent whole was never seen when its mode fails after some tokens: it is generated again elsewhere
    and only the retry's text is returned. A stream that has sent tokens ends with an error event instead."""
    app = make_app(policy=RETRY_POLICY, scripts={"fp16": Script(fail_after=3)})
    whole = app.complete("The capital of France is", max_tokens=6)
    reference = app.complete("The capital of France is", max_tokens=6, mode="prefix_cache")
    assert whole["modeswitch"]["mode"] == "prefix_cache" and whole["modeswitch"]["attempts"] == [
        "fp16: RuntimeError: injected fault after tokens"]
    assert whole["choices"][0]["text"] == reference["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 6
    pinned = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "mode": "fp16", "temperature": 0})
    assert pinned.status_code == 503 and pinned.get_json()["error"]["code"] in ("mode_failed", "mode_quarantined")
    app.service.registry.modes["fp16"].quarantined_until = 0.0
    stream = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 6, "stream": True, "temperature": 0})
    events = [line for line in stream.get_data(as_text=True).split("\n") if line.startswith("data: ")]
    assert '"mode_failed"' in events[-2] and events[-1] == "data: [DONE]"
    assert all(m["in_flight"] == 0 for m in app.modes().values())


def test_burst_of_10x_capacity_loses_nothing_and_health_stays_fast(make_app):
    """30 requests at once (10x the client's limit of 3): the excess gets 429, the rest full answers."""
    app = make_app(max_inflight_per_client=3, scripts={"continuous_batching": Script(token_s=0.02)})
    url = app.serve()
    body = {"prompt": "Count: one, two,", "max_tokens": 12, "temperature": 0, "mode": "continuous_batching"}
    health_ms, stop_probe = [], threading.Event()

    def probe():
        while not stop_probe.is_set():
            t0 = time.perf_counter()
            assert requests.get(url + "/health", timeout=10).status_code == 200
            health_ms.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    with ThreadPoolExecutor(30) as pool:
        resps = list(pool.map(lambda _: requests.post(url + "/v1/completions", json=body, timeout=60), range(30)))
    stop_probe.set()
    prober.join()
    ok = [r for r in resps if r.status_code == 200]
    limited = [r for r in resps if r.status_code == 429]
    assert len(ok) + len(limited) == 30 and ok and limited
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in ok)
    assert all(r.headers["Retry-After"].isdigit() and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in limited)
    # a response is sent whole before the server's request ends and hands its admission back: counted soon after
    wait_for(lambda: requests.get(url + "/health", timeout=10).json()["in_flight"] == 0, 5)
    health_ms.sort()
    p99 = health_ms[min(len(health_ms) - 1, int(0.99 * len(health_ms)))]
    print(f"burst: sent 30, accepted {len(ok)}, rejected {len(limited)}, lost 0; /health p50 "
          f"{statistics.median(health_ms):.1f} ms p99 {p99:.1f} ms over {len(health_ms)} probes")
    assert p99 < 1000


def test_a_dropped_stream_cancels_its_generation_and_frees_its_slot(make_app):
    app = make_app(scripts={"prefix_cache": Script(token_s=0.05)})
    url = app.serve()
    body = {"prompt": "A very long story", "max_tokens": 400, "mode": "prefix_cache", "stream": True}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert generating(resp)  # a few tokens, then hang up
    modes = wait_idle(app, timeout=5.0)  # 400 tokens would take 20 s
    assert modes["prefix_cache"]["in_flight"] == 0
    assert app.get("/health").get_json()["in_flight"] == 0


def test_metrics_count_requests_decisions_and_prefix_hits(make_app):
    app = make_app(unavailable={"continuous_batching": "not here"})
    before = scrape(app)
    prompt = "Metrics are counted per mode. " * 6
    first = app.complete(prompt + "One", max_tokens=5, mode="prefix_cache")
    app.complete(prompt + "Two", max_tokens=5, mode="prefix_cache")
    after = scrape(app)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("modeswitch_requests_total", mode="prefix_cache", outcome="ok") == 2
    assert delta("modeswitch_generated_tokens_total", mode="prefix_cache") == 10
    assert delta("modeswitch_prompt_tokens_total", mode="prefix_cache") == 2 * first["usage"]["prompt_tokens"]
    assert delta("modeswitch_decisions_total", mode="prefix_cache", rule="pinned") == 2
    assert delta("modeswitch_ttft_seconds_count", mode="prefix_cache") == 2
    assert delta("modeswitch_request_seconds_count", mode="prefix_cache") == 2
    assert delta("modeswitch_prefix_cache_queries_total", mode="prefix_cache") == 2
    assert delta("modeswitch_prefix_cache_hits_total", mode="prefix_cache") == 1  # the second reused the first
    assert delta("modeswitch_prefix_cache_hit_tokens_total", mode="prefix_cache") >= len(prompt)
    assert metric(after, "modeswitch_mode_available", mode="fp16") == 1
    assert metric(after, "modeswitch_mode_available", mode="continuous_batching") == 0
    assert 0 < metric(after, "modeswitch_memory_headroom") <= 1
    assert metric(after, "modeswitch_decision_seconds_count") >= 2


LEARNED = """name: learned-test
type: learned
modes: [prefix_cache, fp16]   # prefix_cache first: what the rule table would pick
explore: {min_samples: 2, epsilon: 0.05, seed: 3}
state: learned_state.json
"""


def test_the_learned_policy_leaves_a_mode_that_is_slow_here(make_app, tmp_path):
    app = make_app(modes=("fp16", "prefix_cache"), policy=LEARNED, scripts={"prefix_cache": Script(ttft_s=0.2)})
    words = "hacker kludge cruft foo bar baz quux frob grovel hairy".split()
    modes = []
    for i in range(14):
        info = app.complete(f"Request {i}: the {words[i % 10]} was {' '.join(words[: 1 + i % 7])}",
                            max_tokens=4)["modeswitch"]
        modes.append(info["mode"])
    assert modes[:4].count("prefix_cache") == 2  # cold start: each mode tried twice
    assert modes[-6:] == ["fp16"] * 6, modes
    assert info["prediction"]["latency_s"] > 0 and "lowest predicted cost" in info["reason"]
    before = app.get("/admin/policy").get_json()
    assert before["type"] == "learned" and before["observations"]["prefix_cache"] >= 2
    # reloading the file saves the state first and restores it: nothing learned is lost
    after = app.post("/admin/policy", json={}).get_json()
    assert after["observations"] == before["observations"]
    assert (app.policy_file.parent / "learned_state.json").is_file()


def test_a_request_routes_only_once_the_one_before_it_is_submitted(make_app):
    """One request's features, decision and submission end before the next request's features are read, so
    a burst of requests sees each other in flight (and on vLLM each other's prefixes, recorded at submission)
    instead of all reading an empty server and choosing alike. The first request's feature read is held open
    while the second arrives: the second must wait for it and then count it in flight."""
    app = make_app(policy="rules:\n  - when: {queue_depth: {ge: 1}}\n    use: [continuous_batching]\n"
                          "default: [fp16]\n",
                   scripts={"fp16": Script(token_s=0.05), "continuous_batching": Script(token_s=0.05)})
    engine = app.backend.engines["prefix_cache"]
    reading, release = threading.Event(), threading.Event()
    real_match = engine.prefix_match

    def first_read_waits(prompt_ids):
        if prompt_ids and not reading.is_set():
            reading.set()
            release.wait(5)
        return real_match(prompt_ids)

    engine.prefix_match = first_read_waits
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(app.complete, "first", max_tokens=4)
        assert reading.wait(5)
        second = pool.submit(app.complete, "second", max_tokens=4)
        time.sleep(0.2)  # long enough for the second request to read its features, were it not held back
        release.set()
        first, second = first.result()["modeswitch"], second.result()["modeswitch"]
    assert (first["mode"], first["features"]["queue_depth"]) == ("fp16", 0)
    assert (second["mode"], second["features"]["queue_depth"]) == ("continuous_batching", 1)


def test_a_mode_whose_kernels_are_not_what_its_name_says_is_never_served(make_app):
    """An int8 mode whose engine reports 16-bit linears (a quantization the engine ignored) is listed unavailable
    with what it runs, and a request pinned to it is refused; the reference is served in whatever dtype it runs."""
    bf16 = {"weights": "bfloat16", "weight_format": "dense", "activations": "bfloat16", "compute": "bfloat16",
            "kernel": "oneDNN matmul"}
    int8 = {**bf16, "weights": "int8", "weight_format": "compressed-tensors (w8a8)", "activations": "int8"}
    app = make_app(modes=("fp16", "int8", "int8+prefix_cache"), policy="name: t\nrules: []\ndefault: [int8, fp16]\n",
                   kernels={"fp16": bf16, "int8": bf16, "int8+prefix_cache": int8})
    modes = app.modes()
    assert modes["int8"]["status"] == "unavailable" and modes["int8"]["kernels"] == bf16
    assert modes["int8"]["reason"] == ("its linears run bfloat16 weights (dense, oneDNN matmul) on this machine, "
                                       "not the int8 its name says")
    assert modes["fp16"]["status"] == modes["int8+prefix_cache"]["status"] == "available"
    assert app.complete("Hello")["modeswitch"]["mode"] == "fp16"
    pinned = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "mode": "int8"})
    assert pinned.status_code == 400 and pinned.get_json()["error"]["code"] == "mode_unavailable"
