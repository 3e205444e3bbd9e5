"""Mode files as data, and the pool as the server reports it."""

from __future__ import annotations

import pytest

from modeswitch.modes import load_modes, parse_mode
from modeswitch.yamlconf import ConfigError, load_yaml

REFERENCE = {"fp16", "gptq", "int8", "speculative", "prefix_cache", "continuous_batching", "gptq+prefix_cache",
             "int8+continuous_batching", "int8+prefix_cache"}
HYBRIDS = {"int8+speculative"}  # beyond the reference design's nine
EXTRA = {"speculative_ngram", "speculative_gptq_draft"}  # modes/extra, loaded by the test server


def test_the_reference_set_of_9_modes_and_the_hybrids_are_shipped():
    modes = {m.name: m for m in load_modes()}
    assert set(modes) == REFERENCE | HYBRIDS
    assert modes["gptq+prefix_cache"].weights == "gptq" and modes["gptq+prefix_cache"].prefix_cache
    assert modes["int8+continuous_batching"].batching == "continuous"
    assert modes["int8+prefix_cache"].weights == "int8" and modes["int8+prefix_cache"].prefix_cache
    assert modes["speculative"].speculative.draft == "auto"
    drafting = modes["int8+speculative"]
    assert drafting.weights == "int8" and drafting.speculative.draft == "ngram" and drafting.prefix_cache


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


def test_modes_endpoint_lists_all_available_and_an_unservable_one_with_its_reason(server):
    body = server.get("/v1/modes").json()
    modes = {m["name"]: m for m in body["modes"]}
    assert set(modes) == REFERENCE | HYBRIDS | EXTRA | {"speculative_draft_model"}
    for name in REFERENCE | HYBRIDS | EXTRA:
        assert modes[name]["status"] == "available" and modes[name]["reason"] == "", modes[name]
        assert modes[name]["backend"] == "transformers"
    broken = modes["speculative_draft_model"]
    assert broken["status"] == "unavailable" and "has no draft checkpoint" in broken["reason"]
    assert modes["prefix_cache"]["stats"]["prefix_capacity_tokens"] == 8192
    assert modes["speculative_gptq_draft"]["draft"] == "gptq weights of demo (self-draft)"
    assert body["policy"]["name"] == "paper"


def test_modes_share_weights_and_report_memory(server):
    body = server.get("/v1/modes").json()
    modes = {m["name"]: m["memory"] for m in body["modes"] if m["status"] == "available"}
    mem = body["memory"]
    # three resident copies at most: fp16, gptq, int8 (every other mode shares one of them)
    assert set(mem["weights_bytes"]) == {"fp16", "gptq", "int8"}
    assert mem["weights_total_bytes"] == sum(mem["weights_bytes"].values())
    assert modes["prefix_cache"]["weights_bytes"] == modes["fp16"]["weights_bytes"] == mem["weights_bytes"]["fp16"]
    assert "gptq+prefix_cache" in modes["gptq"]["weights_shared_with"]
    assert "speculative_gptq_draft" in modes["gptq"]["weights_shared_with"]  # the self-draft costs no weights
    assert modes["prefix_cache"]["kv_bytes"] > modes["fp16"]["kv_bytes"] > 0  # stored prefixes are reserved
    assert mem["planned_total_bytes"] <= mem["budget_bytes"]
    startup = body["startup_seconds"]
    assert {"weights:fp16", "weights:gptq", "weights:int8", "mode:prefix_cache"} <= set(startup)
    assert all(t >= 0 for t in startup.values()) and startup["weights:fp16"] > 0


def test_models_and_health(server):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "demo" and models["data"][0]["max_model_len"] == 8192
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["modes_available"] == len(REFERENCE | HYBRIDS | EXTRA)
