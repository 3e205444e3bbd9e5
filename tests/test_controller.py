"""The controller without a model: what a refusal's codes mean, and one quality judgement for the gate
report and the router."""

from __future__ import annotations

import math

import pytest

from modeswitch.controller.quality import QualityPolicy, judge
from modeswitch.controller.verdicts import PRECEDENCE, Code, most_hopeful
from modeswitch.evals.gate import mark, render


# ---------------------------------------------------------------------------------------------- verdicts
def test_waiting_helps_only_for_saturation_quarantine_and_memory():
    assert {c for c in Code if c.transient} == {Code.SATURATED, Code.QUARANTINED, Code.MEMORY}
    assert set(PRECEDENCE) == set(Code)


def test_a_refusal_carries_the_most_hopeful_code_of_its_verdicts():
    assert most_hopeful([Code.UNAVAILABLE, Code.MEMORY, Code.QUARANTINED]) is Code.QUARANTINED
    assert most_hopeful([Code.QUALITY, Code.SATURATED]) is Code.SATURATED
    assert most_hopeful([Code.NOT_LOADED, Code.UNAVAILABLE, Code.CAPABILITY]) is Code.CAPABILITY
    assert most_hopeful([]) is Code.UNAVAILABLE


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
        assert rows[mode].endswith("| pass |") == (router[mode] is None), (mode, rows[mode], router[mode])
        assert all(e["pass"] for e in report["modes"][mode].values()) == (router[mode] is None)
    assert router["nan"] is not None and router["fp16"] is None
