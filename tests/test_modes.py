"""Mode files as data, and the pool as the server reports it."""

from __future__ import annotations

import pytest

from modeswitch.modes import load_modes, parse_mode
from modeswitch.yamlconf import ConfigError, load_yaml

REFERENCE = {"fp16", "gptq", "int8", "speculative", "prefix_cache", "continuous_batching", "gptq+prefix_cache",
             "int8+continuous_batching"}
SERVED_NOW = {"fp16", "speculative", "prefix_cache", "continuous_batching"}


def test_the_reference_set_of_8_modes_is_shipped():
    modes = {m.name: m for m in load_modes()}
    assert set(modes) == REFERENCE
    assert modes["gptq+prefix_cache"].weights == "gptq" and modes["gptq+prefix_cache"].prefix_cache
    assert modes["int8+continuous_batching"].batching == "continuous"
    assert modes["speculative"].speculative.draft == "auto"


@pytest.mark.parametrize("text, fragment", [
    ("name: x\nweights: fp8\n", "m.yaml:2: weights: must be one of fp16, gptq, int8"),
    ("name: x\nweights: fp16\nspeculative: {draft: ngram}\n", "only allowed with decoding: speculative"),
    ("name: x\nweights: fp16\ndecoding: speculative\nbatching: continuous\n", "cannot run under continuous"),
    ("name: x\nweights: fp16\nprefix_cache: 'yes'\n", "m.yaml:3: prefix_cache: expected a boolean"),
    ("name: x\nweights: fp16\nmax_queue: 0\n", "max_queue: must be at least 1"),
    ("weights: fp16\n", "name: is required"),
])
def test_invalid_mode_files_name_the_problem(text, fragment):
    with pytest.raises(ConfigError, match=None) as exc:
        parse_mode(load_yaml("m.yaml", text), "m.yaml")
    assert fragment in str(exc.value)


def test_modes_endpoint_lists_all_8_with_status_and_reason(server):
    body = server.get("/v1/modes").json()
    modes = {m["name"]: m for m in body["modes"]}
    assert set(modes) == REFERENCE
    for name, m in modes.items():
        assert m["engine"] == "transformers"
        if name in SERVED_NOW:
            assert m["status"] == "available" and m["reason"] == ""
        else:
            assert m["status"] == "unavailable" and "not served by the transformers engine yet" in m["reason"]
    assert modes["prefix_cache"]["stats"]["prefix_capacity_tokens"] == 8192
    assert body["policy"]["name"] == "paper"
    # fp16, prefix_cache, speculative and continuous_batching share one copy of the weights (~540 MB fp32)
    assert 400e6 < body["resident_weight_bytes"] < 700e6


def test_models_and_health(server):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "demo" and models["data"][0]["max_model_len"] == 8192
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["modes_available"] == len(SERVED_NOW)
