"""The controller without a model: typed verdicts from every gate, the code a refusal carries, the hook for
completed requests, energy caps through both policy types, ordering by energy within a latency slack, and one
quality judgement for report and router.

Modes are plain objects with the attributes of ``controller.view.ModeView``: no pool, no engine, no server.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modeswitch.controller.completed import Completed
from modeswitch.controller.decide import Controller, NoEligibleMode
from modeswitch.controller.quality import QualityPolicy, judge
from modeswitch.controller.verdicts import PRECEDENCE, Code, Verdict, most_hopeful
from modeswitch.sampling_params import OPTIONS
from modeswitch.evals.gate import mark, render
from modeswitch.serving.metrics import Metrics
from policy_text import MODES, feats, policy_from


@dataclass
class Mode:
    """A resident mode as the controller reads it (``ModeView``), healthy by default."""

    name: str
    batch: str = ""
    available: bool = True
    loading: bool = False
    reason: str = ""
    max_queue: int = 4
    batch_slots: int = 1
    speculative: bool = False
    capabilities: frozenset = OPTIONS
    preallocated_kv: bool = False
    quarantine_s: float = 0.0  # seconds of quarantine left, from now
    last_error: str = ""
    j_per_token: float | None = None
    watts: float | None = None
    kernels: dict | None = None

    @property
    def quarantined_until(self) -> float:
        return time.monotonic() + self.quarantine_s if self.quarantine_s else 0.0


def controller(policy_text: str, *modes: Mode, defined=()) -> Controller:
    return Controller({m.name: m for m in modes}, policy_from(policy_text), kv_bytes_per_token=1024,
                      defined_modes=defined)


RULES = "rules: []\ndefault: [fp16, gptq]\n"
LEARNED = "type: learned\nmodes: [fp16, gptq]\nexplore: {min_samples: 0, epsilon: 0}\n"


# ---------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("mode, request_features, code, detail", [
    (Mode("gptq", available=False, reason="no GPTQ checkpoint"), {}, Code.UNAVAILABLE,
     "unavailable: no GPTQ checkpoint"),
    (Mode("gptq", available=False, loading=True), {}, Code.LOADING,
     "loading: its engine starts after the server began serving"),
    (Mode("gptq", quarantine_s=4.2, last_error="CUDA OOM"), {}, Code.QUARANTINED,
     "quarantined for 4 s after: CUDA OOM"),
    (Mode("gptq", capabilities=frozenset()), {"greedy": 0, "needs": ("temperature",)}, Code.CAPABILITY,
     "cannot honour temperature"),
    (Mode("gptq", capabilities=OPTIONS - {"prompt_logprobs", "logprobs"}),
     {"needs": ("logprobs", "prompt_logprobs", "seed")}, Code.CAPABILITY, "cannot honour logprobs, prompt_logprobs"),
    (Mode("gptq"), {"queue_depth": 4, "in_flight_by_mode": {"gptq": 4}}, Code.SATURATED, "saturated: 4/4 in flight"),
    (Mode("gptq"), {"memory_headroom": 0.01, "prompt_tokens": 1000, "max_tokens": 24}, Code.MEMORY,
     "memory pressure: 1.0% free < 5.0%, and this mode would allocate ~1.0 MiB of KV for the request"),
    (Mode("gptq", j_per_token=3.0), {}, Code.ENERGY,
     "energy: 3 J/token over the cap of 2 (energy.max_j_per_token)"),
])
def test_each_gate_answers_with_its_code_and_the_reason_people_read(mode, request_features, code, detail):
    ctl = controller(RULES + "energy: {max_j_per_token: 2.0}\n", Mode("fp16", preallocated_kv=True), mode)
    filtered = ctl.filter(feats(**request_features))
    assert filtered == {"gptq": Verdict(code, detail)}
    assert str(filtered["gptq"]) == detail


def test_the_controller_codes_modes_left_out_or_excluded_and_the_quality_gate_codes_its_own():
    ctl = controller("rules: []\ndefault: [fp16, gptq, int8]\nquality: {require_gate: true}\n",
                     Mode("fp16"), Mode("gptq"), Mode("int8"), defined=MODES)
    ctl.quality_report = {"tasks": {"ppl": {"higher_is_better": False}},
                          "modes": {"fp16": {"ppl": {"value": 100.0}}, "gptq": {"ppl": {"value": 140.0}}}}
    filtered = ctl.filter(feats(), exclude=frozenset({"fp16"}))
    assert filtered["fp16"] == Verdict(Code.EXCLUDED, "excluded after a failed attempt")
    assert filtered["gptq"] == Verdict(Code.QUALITY, "fails the quality gate (ppl +40.0 %)")
    assert filtered["int8"] == Verdict(Code.QUALITY, "not in the quality gate report (require_gate)")
    assert filtered["continuous_batching"] == Verdict(Code.NOT_LOADED, "not loaded (--modes)")


def test_waiting_helps_only_for_saturation_quarantine_memory_and_loading():
    assert {c for c in Code if c.transient} == {Code.SATURATED, Code.QUARANTINED, Code.MEMORY, Code.LOADING}
    assert set(PRECEDENCE) == set(Code)


# ---------------------------------------------------------------------------------------------- refusals
def test_a_refusal_carries_the_most_hopeful_code_of_its_verdicts():
    assert most_hopeful([Code.UNAVAILABLE, Code.MEMORY, Code.QUARANTINED]) is Code.QUARANTINED
    assert most_hopeful([Code.QUALITY, Code.SATURATED]) is Code.SATURATED
    assert most_hopeful([Code.NOT_LOADED, Code.UNAVAILABLE, Code.CAPABILITY]) is Code.CAPABILITY
    assert most_hopeful([]) is Code.UNAVAILABLE

    ctl = controller(RULES, Mode("fp16"), Mode("gptq", available=False, reason="x"))
    with pytest.raises(NoEligibleMode) as exc:
        ctl.decide(feats(queue_depth=4, in_flight_by_mode={"fp16": 4}))
    assert exc.value.code is Code.SATURATED and exc.value.code.transient
    ctl.modes["fp16"].capabilities = frozenset()
    with pytest.raises(NoEligibleMode) as exc:
        ctl.decide(feats(greedy=0, needs=("temperature",)))
    assert exc.value.code is Code.CAPABILITY and not exc.value.code.transient


def test_while_the_policys_modes_load_a_request_goes_to_a_mode_that_passed_every_gate():
    ctl = controller("rules: []\ndefault: [gptq]\n", Mode("fp16", capabilities=frozenset()),
                     Mode("gptq", available=False, loading=True), Mode("int8"))
    decision = ctl.decide(feats(greedy=0, needs=("temperature",)))
    assert (decision.mode, decision.rule) == ("int8", "while-loading")  # fp16 fails the capability gate
    assert "served by int8 while those load" in decision.reason
    with pytest.raises(NoEligibleMode) as exc:  # pinned: no substitute
        ctl.decide(feats(), pinned="gptq")
    assert exc.value.code is Code.LOADING and exc.value.code.transient
    ctl.modes["gptq"].loading = False  # failed to load: nothing stands in for it
    with pytest.raises(NoEligibleMode):
        ctl.decide(feats())


def test_a_pinned_mode_is_refused_with_its_own_code():
    ctl = controller(RULES, Mode("fp16"), Mode("gptq", quarantine_s=3.0, last_error="boom"))
    with pytest.raises(NoEligibleMode) as exc:
        ctl.decide(feats(), pinned="gptq")
    assert exc.value.code is Code.QUARANTINED and "quarantined for 3 s after: boom" in str(exc.value)


def test_the_capacity_gate_reads_the_requests_in_flight_the_features_count():
    """A mode whose count of requests in flight, as the request's features give it, reaches its queue bound is
    saturated; with fewer in flight over all modes than the smallest bound no mode is asked (one filled since is
    caught when it refuses the submission). The bounds are read again when a mode's standing changes (a
    restarted engine may bound its queue otherwise)."""
    changes = [0]
    modes = {"fp16": Mode("fp16"), "gptq": Mode("gptq", max_queue=8)}
    ctl = Controller(modes, policy_from(RULES), standing=lambda: changes[0])
    four = {"fp16": 4}
    assert ctl.filter(feats(queue_depth=3, in_flight_by_mode={"fp16": 3})) == {}
    assert ctl.filter(feats(queue_depth=4, in_flight_by_mode=four)) == {
        "fp16": Verdict(Code.SATURATED, "saturated: 4/4 in flight")}
    assert ctl.filter(feats(queue_depth=3, in_flight_by_mode=four)) == {}  # a stale count, below every bound
    modes["fp16"].max_queue = 2
    assert ctl.filter(feats(queue_depth=3, in_flight_by_mode={"fp16": 3})) == {}  # its standing unchanged
    changes[0] += 1
    assert ctl.filter(feats(queue_depth=3, in_flight_by_mode={"fp16": 3})) == {
        "fp16": Verdict(Code.SATURATED, "saturated: 3/2 in flight")}


# ---------------------------------------------------------------------------------------------- observers
def finished(mode: str = "fp16", outcome: str = "ok", ttft_s: float | None = 0.1, retried: bool = False,
             scoring: bool = False) -> Completed:
    return Completed(mode, feats(), outcome, ttft_s, 0.02, 0.8, 100, 32, 4.0, "estimated", retried, scoring)


def test_every_completed_request_reaches_the_observers_and_the_policy_picks_what_it_learns():
    ctl = controller(LEARNED, Mode("fp16"), Mode("gptq"))
    seen = []
    ctl.add_observer(seen.append)
    records = [finished(), finished(outcome="error"), finished(outcome="cancelled"), finished(retried=True),
               finished(scoring=True), finished(ttft_s=None), finished(mode="int8"), finished(mode="gptq")]
    for record in records:
        ctl.observe(record)
    assert seen == records
    observed = {m: model.n for m, model in ctl.policy.models.items()}
    assert observed == {"fp16": 1, "gptq": 1}  # the clean ones on its own modes


def test_metrics_count_completed_requests_through_the_hook():
    ctl = controller(RULES, Mode("fp16"))
    metrics = Metrics()
    ctl.add_observer(metrics.finished)
    ctl.observe(finished())
    ctl.observe(finished(outcome="cancelled", ttft_s=None))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    assert samples[("modeswitch_requests_total", (("mode", "fp16"), ("outcome", "ok")))] == 1
    assert samples[("modeswitch_requests_total", (("mode", "fp16"), ("outcome", "cancelled")))] == 1
    assert samples[("modeswitch_energy_joules_total", (("mode", "fp16"), ("source", "estimated")))] == 8.0
    assert samples[("modeswitch_generated_tokens_total", (("mode", "fp16"),))] == 64
    assert samples[("modeswitch_ttft_seconds_count", (("mode", "fp16"),))] == 1
    assert samples[("modeswitch_request_seconds_count", (("mode", "fp16"),))] == 2


# ---------------------------------------------------------------------------------------------- energy caps
def test_energy_caps_through_both_policy_types():
    energy = "energy: {max_j_per_token: 2.0, modes: {gptq: 5.0}}\n"
    rules = policy_from("rules:\n  - name: long\n    when: {max_tokens: {ge: 100}}\n    use: [fp16]\n"
                        "    energy: {max_j_per_token: 0.5}\ndefault: [fp16, gptq]\n" + energy)
    learned = policy_from(LEARNED + energy)
    short, long_ = feats(max_tokens=10), feats(max_tokens=200)
    for policy in (rules, learned):
        assert policy.energy_cap("fp16", short) == (2.0, "energy.max_j_per_token")
        assert policy.energy_cap("gptq", short) == (5.0, "energy.modes.gptq")
    assert rules.energy_cap("gptq", long_) == (0.5, "rule 'long'")  # the matching rule's cap is tighter
    assert learned.energy_cap("gptq", long_) == (5.0, "energy.modes.gptq")  # no rules: the energy block alone
    assert policy_from(LEARNED).energy_cap("fp16", short) is None

    ctl = controller(LEARNED + energy, Mode("fp16", j_per_token=3.0), Mode("gptq", j_per_token=3.0))
    decision = ctl.decide(short)
    assert decision.mode == "gptq" and decision.filtered["fp16"].code is Code.ENERGY


# ---------------------------------------------------------------------------------------------- quality
def gate_report(tolerance: dict) -> dict:
    """A report as the gate writes it (values as lm-eval gave them), before its verdicts are marked."""
    def results(cloze: float, ppl: float) -> dict:
        return {"cloze": {"metric": "acc,none", "value": cloze, "stderr": 0.03},
                "ppl": {"metric": "word_perplexity,none", "value": ppl, "stderr": None}}

    return {"model": "demo", "date": "today", "limit": 10, "seconds": 1.0, "tolerance": tolerance,
            "tasks": {"cloze": {"metric": "acc,none", "higher_is_better": True},
                      "ppl": {"metric": "word_perplexity,none", "higher_is_better": False}},
            "modes": {"fp16": results(0.80, 100.0), "close": results(0.795, 109.0), "far": results(0.77, 100.0),
                      "nan": results(0.80, math.nan)},  # a broken mode: its perplexity came out NaN
            "unavailable": {}}


@pytest.mark.parametrize("tolerance", [QualityPolicy().tolerance(), {"max_drop_pp": 5.0, "max_ppl_increase_pct": 5.0}])
def test_the_gate_report_and_the_router_judge_every_mode_alike(tolerance):
    """The markdown's verdict per mode is what the router's quality gate and /v1/modes say under the same
    tolerances; a NaN metric used to fail in the report and pass in the router."""
    report = gate_report(tolerance)
    mark(report)
    rows = {line.split(" | ")[0][2:]: line for line in render(report).splitlines() if line.startswith("| ")}
    router = judge(report, QualityPolicy(**tolerance), "general")
    for mode in report["modes"]:
        assert (" | pass | " in rows[mode]) == (router[mode] is None), (mode, rows[mode], router[mode])
        assert all(e["pass"] for e in report["modes"][mode].values()) == (router[mode] is None)
    assert router["nan"] is not None and router["fp16"] is None


# ---------------------------------------------------------------------------------------------- layering
def test_the_controller_imports_no_registry_engine_or_eval_harness():
    code = ("import sys, modeswitch.controller.decide, modeswitch.controller.quality; "
            "print(sorted(m for m in ('modeswitch.serving.registry', 'modeswitch.backends', 'modeswitch.engines', 'torch', 'lm_eval') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



ENERGY_ORDER = "rules: []\ndefault: [fp16, int8, gptq]\norder: energy\nlatency_slack: 1.25\n"


def test_an_energy_ordered_policy_takes_the_least_predicted_joules_within_its_latency_slack():
    """Of the modes predicted within the slack of the fastest, the one whose predicted seconds at its measured watts
    come to the fewest joules; a mode outside the slack never, however frugal; one with no figure yet is not compared
    on a guess."""
    from modeswitch.controller.costs import Prediction

    times = {"fp16": 1.0, "int8": 1.2, "gptq": 2.0}
    watts = {"fp16": 1.0, "int8": 0.5, "gptq": 0.1}

    def predict(mode):
        return Prediction(times[mode], 0.0, 0.0, 0.1, times[mode] - 0.1) if mode in times else None

    policy = policy_from(ENERGY_ORDER)
    choice = policy.choose(feats(), {}, predict, watts.get)
    assert choice.mode == "int8" and choice.prediction["runner_up"]["mode"] == "fp16"
    assert "least energy within 1.25x of the fastest: 0.6 J predicted" in choice.reason
    watts["int8"] = 0.9  # 1.08 J: fewer watts than fp16's, more joules over its longer time
    assert policy.choose(feats(), {}, predict, watts.get).mode == "fp16"
    watts["int8"], times["int8"] = 0.5, 1.3  # now outside the slack: the fastest
    assert policy.choose(feats(), {}, predict, watts.get).mode == "fp16"
    times["int8"] = 1.2
    unmeasured = {"fp16": 1.0, "int8": None, "gptq": 0.1}
    assert policy.choose(feats(), {}, predict, unmeasured.get).mode == "fp16"
    choice = policy.choose(feats(), {}, predict, lambda m: None)
    assert choice.mode == "fp16" and "no mode within 1.25x of it has served a request" in choice.reason
    assert policy_from(ENERGY_ORDER.replace("1.25", "1")).choose(feats(), {}, predict, watts.get).mode == "fp16"
    assert policy.orders_by_measurement and policy.describe()["latency_slack"] == 1.25
    with pytest.raises(Exception, match="latency_slack.*at least 1"):
        policy_from(ENERGY_ORDER.replace("1.25", "0.8"))


def test_the_controller_prices_an_energy_ordered_policys_predictions_at_each_modes_running_watts():
    """Through ``decide``: the modes' own running figures (``ModeView.watts``) and the measured costs."""
    from modeswitch.controller.costs import Binding, CostModel

    names = ("fp16", "int8", "gptq")
    costs = CostModel()
    costs.bind(Binding(streams={m: m for m in names}, lanes={}, engines={m: m for m in names},
                       slots={m: 8 for m in names}))
    for m, step in (("fp16", 0.010), ("int8", 0.011), ("gptq", 0.030)):
        costs.add_prefill(m, 16, 0.01)
        costs.add_step(m, 1, step)
    modes = {"fp16": Mode("fp16", watts=60.0), "int8": Mode("int8", watts=30.0), "gptq": Mode("gptq", watts=5.0)}
    ctl = Controller(modes, policy_from(ENERGY_ORDER), costs=costs)
    decision = ctl.decide(feats())
    assert decision.mode == "int8" and "J predicted" in decision.reason
    modes["int8"].watts = None  # as before its first request: not compared on a guess
    assert ctl.decide(feats()).mode == "fp16"
    fastest = Controller(modes, policy_from(ENERGY_ORDER.replace("energy", "predicted")), costs=costs)
    modes["int8"].watts = 30.0
    assert fastest.decide(feats()).mode == "fp16"  # the same figures, ordered by time alone
