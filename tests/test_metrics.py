"""/metrics parses with prometheus_client's own parser, and its counters move with real requests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape(server) -> dict:
    resp = server.get("/metrics")
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_increase_with_requests(server):
    before = scrape(server)
    prompt = "Metrics are counted per mode. " * 6
    first = server.complete(prompt + "One", max_tokens=5, mode="prefix_cache")
    server.complete(prompt + "Two", max_tokens=5, mode="prefix_cache")
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("modeswitch_requests_total", mode="prefix_cache", outcome="ok") == 2
    generated = first["usage"]["completion_tokens"]
    assert delta("modeswitch_generated_tokens_total", mode="prefix_cache") >= generated
    assert delta("modeswitch_prompt_tokens_total", mode="prefix_cache") >= 2 * first["usage"]["prompt_tokens"] - 2
    assert delta("modeswitch_decisions_total", mode="prefix_cache", rule="pinned") == 2
    assert delta("modeswitch_ttft_seconds_count", mode="prefix_cache") == 2
    assert delta("modeswitch_request_seconds_count", mode="prefix_cache") == 2
    assert delta("modeswitch_prefix_cache_queries_total", mode="prefix_cache") == 2
    assert delta("modeswitch_prefix_cache_hits_total", mode="prefix_cache") >= 1  # the second reused the first
    assert delta("modeswitch_prefix_cache_hit_tokens_total", mode="prefix_cache") >= 30
    # gauges read at scrape time: every mode reported, the pool's weights, memory
    assert value(after, "modeswitch_mode_available", mode="fp16") == 1
    assert value(after, "modeswitch_mode_available", mode="speculative_draft_model") == 0
    assert ("modeswitch_mode_in_flight", (("mode", "continuous_batching"),)) in after
    assert value(after, "modeswitch_weights_bytes", weights="gptq") > 0
    assert 0 < value(after, "modeswitch_memory_headroom") <= 1
    assert value(after, "modeswitch_decision_seconds_count") >= 2
