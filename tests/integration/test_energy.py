"""Energy: roofline attribution inside steps, the estimating meter's label, the energy and memory gates."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modeswitch.config import LoadConfig
from modeswitch.controller.decide import Controller, NoEligibleMode
from modeswitch.controller.verdicts import Code
from modeswitch.energy import HARDWARE, ESTIMATED, EnergyAccountant, EstimatingMeter, Share, StepCost
from modeswitch.weights.presets import PRESETS
from modeswitch.modes import load_modes
from modeswitch.serving.registry import ModeRegistry
from modeswitch.yamlconf import ConfigError
from policy_text import feats, policy_from

# SmolLM2-135M-shaped: 106 M matmul weights, 30 layers x 9 heads x 64, 538 MB of fp32 weights
SMOL = StepCost(matmul_params=106_000_000, attn_width=30 * 9 * 64, weight_bytes=538_000_000,
                kv_bytes_per_token=46_080, hardware=HARDWARE["cpu"])


class Sink:
    def __init__(self) -> None:
        self.energy_j = 0.0


class Clock:
    """A clock the test advances by hand, driving the real estimating meter."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_roofline_prefill_costs_more_than_decode_and_batching_shares_the_weights():
    prefill = SMOL.seconds(new_tokens=512, kv_tokens=512)
    decode = SMOL.seconds(new_tokens=1, kv_tokens=513)
    assert prefill > 10 * decode
    # decode is memory-bound: in a batch of 8 each request reads an eighth of the weights
    assert SMOL.seconds(1, 513, batch_size=8) < decode / 4
    # longer KV costs more to read
    assert SMOL.seconds(1, 4000) > SMOL.seconds(1, 100)


def test_step_shares_sum_to_the_meter_delta_and_follow_the_cost_model():
    clock = Clock()
    accountant = EnergyAccountant(EstimatingMeter(100.0, clock))
    heavy, light = Sink(), Sink()
    w_heavy, w_light = SMOL.seconds(512, 512, 2), SMOL.seconds(1, 300, 2)
    with accountant.step([Share(heavy, w_heavy), Share(light, w_light)]):
        clock.t += 0.5  # 50 J at 100 W
    assert heavy.energy_j + light.energy_j == pytest.approx(50.0)
    assert heavy.energy_j > light.energy_j
    assert heavy.energy_j / light.energy_j == pytest.approx(w_heavy / w_light)


def test_overlapping_steps_of_two_engines_and_idle_time_add_up_to_the_meter():
    clock = Clock()
    meter = EstimatingMeter(10.0, clock)
    accountant = EnergyAccountant(meter)
    start = meter.joules()
    a, b = Sink(), Sink()
    clock.t += 1.0                                   # idle: 10 J
    ta = accountant.begin([Share(a, 1.0)])
    clock.t += 1.0                                   # a alone: 10 J
    tb = accountant.begin([Share(b, 3.0)])
    clock.t += 2.0                                   # a and b: 20 J split 1:3
    accountant.end(ta)
    clock.t += 1.0                                   # b alone: 10 J
    accountant.end(tb)
    clock.t += 0.5                                   # idle: 5 J
    totals = accountant.totals()
    assert a.energy_j == pytest.approx(10 + 5)
    assert b.energy_j == pytest.approx(15 + 10)
    assert totals["attributed_j"] == pytest.approx(a.energy_j + b.energy_j)
    assert totals["idle_j"] == pytest.approx(15.0)
    assert totals["attributed_j"] + totals["idle_j"] == pytest.approx(meter.joules() - start)


def test_estimating_meter_is_labelled_and_needs_a_power_figure():
    assert EstimatingMeter(65.0).source == ESTIMATED
    with pytest.raises(ValueError, match="positive"):
        EstimatingMeter(0)


def test_responses_and_metrics_carry_estimated_energy(server):
    def energy_counter() -> float:
        text = server.get("/metrics").text
        total = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "modeswitch_energy_joules":
                for s in family.samples:
                    if s.name.endswith("_total") and s.labels["mode"] == "fp16":
                        assert s.labels["source"] == "estimated"
                        total += s.value
        return total

    before = energy_counter()
    body = server.complete("Energy is what a request costs", max_tokens=8, mode="fp16")
    usage, info = body["usage"], body["modeswitch"]["energy"]
    assert usage["energy_source"] == "estimated" == info["energy_source"]
    assert usage["energy_j"] > 0 and info["j_per_token"] == pytest.approx(usage["energy_j"] / usage["completion_tokens"], rel=1e-3)
    assert energy_counter() == pytest.approx(before + usage["energy_j"], rel=1e-3)
    modes = {m["name"]: m for m in server.get("/v1/modes").json()["modes"]}
    assert modes["fp16"]["energy"]["source"] == "estimated" and modes["fp16"]["energy"]["j_per_token"] > 0
    watts = modes["fp16"]["energy"]["watts"]  # what order: energy prices a prediction at, as /metrics says too
    assert watts > 0 and any(s.value == pytest.approx(watts, rel=1e-3) for family in
                             text_string_to_metric_families(server.get("/metrics").text)
                             if family.name == "modeswitch_mode_watts" for s in family.samples
                             if s.labels["mode"] == "fp16")


# ---------------------------------------------------------------------------------------------- energy gate
def gated_controller(text: str) -> Controller:
    modes = [m for m in load_modes() if m.name in ("fp16", "gptq", "int8")]
    pool = ModeRegistry(PRESETS["demo"], modes, LoadConfig(backend="transformers", device="cpu"))
    for state in pool.modes.values():
        state.status = "available"  # as after a successful load (no engines needed to decide)
    return Controller(pool.modes, policy_from(text))


def test_energy_gate_filters_modes_over_their_cap():
    controller = gated_controller(
        "rules:\n  - name: long\n    when: {max_tokens: {ge: 100}}\n    use: [gptq, int8, fp16]\n"
        "    energy: {max_j_per_token: 0.5}\n"
        "default: [gptq, int8, fp16]\nenergy: {max_j_per_token: 2.0, modes: {int8: 5.0}}\n")
    modes = controller.modes
    # no figures yet: nothing to judge, the policy's first choice
    assert controller.decide(feats()).mode == "gptq"
    modes["gptq"].record_energy(30.0, 10)   # 3 J/token: over the global 2.0
    modes["int8"].record_energy(40.0, 10)   # 4 J/token: within its own 5.0
    modes["fp16"].record_energy(10.0, 10)   # 1 J/token
    decision = controller.decide(feats())
    assert decision.mode == "int8"
    assert decision.filtered["gptq"].code is Code.ENERGY
    assert str(decision.filtered["gptq"]).startswith("energy: 3 J/token over the cap of 2 (energy.max_j_per_token)")
    # a matching rule's cap is tighter still: only modes under 0.5 J/token; none is, so nothing is eligible
    with pytest.raises(NoEligibleMode):
        controller.decide(feats(max_tokens=200))
    modes["fp16"].record_energy(0.0, 10)    # running mean moves towards 0: 0.8 J/token
    assert modes["fp16"].j_per_token == pytest.approx(0.8)
    for _ in range(3):
        modes["fp16"].record_energy(0.0, 10)
    decision = controller.decide(feats(max_tokens=200))
    assert decision.mode == "fp16" and "(rule 'long')" in str(decision.filtered["int8"])


def test_energy_gate_matches_the_rules_once_per_request(monkeypatch):
    """Three modes with figures to judge, one request: the policy's rules are walked by the policy's own
    choice and once by the gate, not once per mode."""
    controller = gated_controller("rules: []\ndefault: [gptq, int8, fp16]\nenergy: {max_j_per_token: 2.0}\n")
    for name in ("gptq", "int8", "fp16"):
        controller.modes[name].record_energy(1.0, 10)
    calls = []
    policy_type = type(controller.policy)
    original = policy_type.match
    monkeypatch.setattr(policy_type, "match", lambda self, f: calls.append(f) or original(self, f))
    controller.decide(feats())
    controller.decide(feats())
    assert len(calls) == 4 and calls[0] is calls[1] and calls[2] is not calls[0]


@pytest.mark.parametrize("text, fragment", [
    ("rules: []\ndefault: fp16\nenergy: {max_j_per_token: -1}\n", "must be positive"),
    ("rules: []\ndefault: fp16\nenergy: {modes: {fp17: 1}}\n", "unknown mode"),
    ("rules: []\ndefault: fp16\nenergy: {cap: 1}\n", "cap: unknown field"),
    ("rules: []\ndefault: fp16\nmemory: {min_headroom: 1.5}\n", "fraction"),
    ("rules:\n  - use: fp16\n    energy: {max_j: 1}\ndefault: fp16\n", "max_j: unknown field"),
])
def test_invalid_energy_and_memory_blocks_are_rejected(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        policy_from(text)


def test_energy_gate_on_the_server_moves_requests_off_an_expensive_mode(server):
    original = server.policy_file.read_text()
    prompt = "Moving off the expensive mode"
    try:
        server.complete(prompt, max_tokens=4, mode="prefix_cache")  # gives prefix_cache a J/token figure
        server.policy_file.write_text(original + "\nenergy: {modes: {prefix_cache: 1.0e-9}}\n")
        assert server.post("/admin/policy", json={"path": str(server.policy_file)}).status_code == 200
        info = server.complete(prompt, max_tokens=4)["modeswitch"]  # paper.yaml's default is prefix_cache
        assert info["mode"] != "prefix_cache"
        assert "prefix_cache: energy:" in info["reason"] and "energy.modes.prefix_cache" in info["reason"]
    finally:
        server.policy_file.write_text(original)
        server.post("/admin/policy", json={"path": str(server.policy_file)})


def test_memory_gate_degrades_to_preallocated_modes_then_answers_503(server):
    """Headroom made low by raising the policy's floor above what is free: requests go to modes whose KV is
    reserved at start (continuous batching), and a request none of them can serve gets 503 + Retry-After."""
    original = server.policy_file.read_text()
    try:
        server.policy_file.write_text(original + "\nmemory: {min_headroom: 0.9999}\n")
        assert server.post("/admin/policy", json={"path": str(server.policy_file)}).status_code == 200
        info = server.complete("Under memory pressure", max_tokens=4)["modeswitch"]
        assert info["mode"] in ("continuous_batching", "int8+continuous_batching")
        assert "memory pressure" in info["reason"]
        # sampling: the continuous-batching modes cannot, and everything else would allocate KV
        resp = server.post("/v1/completions", json={"model": "demo", "prompt": "Hot", "max_tokens": 4,
                                                    "temperature": 0.7})
        assert resp.status_code == 503 and resp.headers.get("Retry-After")
        assert resp.json()["error"]["code"] == "insufficient_memory"
    finally:
        server.policy_file.write_text(original)
        server.post("/admin/policy", json={"path": str(server.policy_file)})
    assert server.complete("Pressure is gone", max_tokens=2)["modeswitch"]["mode"] not in (
        "continuous_batching", "int8+continuous_batching")
