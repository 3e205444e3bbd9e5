"""The quality gate judges the kernels that serve: a mode whose gate rows were scored on other kernels is pending
(served only when pinned, and the answer says so), reports hold one run per set of kernels, and the shipped vLLM
report holds a run for the float32 kernels the test servers run on this machine class.

The controller over plain mode views, the API over the fake backend (``make_app``): no model, no engine.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from modeswitch.controller.decide import Controller, NoEligibleMode
from modeswitch.controller.quality import QualityPolicy, judge_mode, runs
from modeswitch.weight_kinds import REFERENCE_MODE
from modeswitch.controller.verdicts import Code
from modeswitch.evals.gate import mark, merged, render
from policy_text import feats, policy_from
from test_controller import Mode
from waiting import wait_for

BF16 = {"weights": "bfloat16", "weight_format": "dense", "activations": "bfloat16", "compute": "bfloat16",
        "kernel": "oneDNN matmul"}
FP32 = {**BF16, "weights": "float32", "activations": "float32", "compute": "float32"}
INT8_BF16 = {**BF16, "weights": "int8", "weight_format": "compressed-tensors (w8a8)",
             "activations": "int8 (dynamic, per token)"}
INT8_FP32 = {**INT8_BF16, "compute": "float32"}


def run(date: str, kernels: dict, cloze: dict) -> dict:
    """A gate run as the gate writes it: every mode's cloze accuracy, and the kernels each row was scored on."""
    scored = {"model": "demo", "backend": "vllm", "date": date, "limit": 100, "seconds": 1.0,
              "tolerance": QualityPolicy().tolerance(),
              "tasks": {"cloze": {"metric": "acc,none", "higher_is_better": True}},
              "modes": {m: {"cloze": {"metric": "acc,none", "value": v, "stderr": 0.03}} for m, v in cloze.items()},
              "kernels": {m: {**kernels[m], "engine": f"vllm:{m}"} for m in cloze}, "unavailable": {}}
    mark(scored)
    return scored


#: int8 passes on bf16 kernels (another machine's verdict) and fails on float32 ones
BF16_RUN = run("2026-12-03", {"fp16": BF16, "int8": INT8_BF16}, {"fp16": 0.86, "int8": 0.86})
FP32_RUN = run("2026-12-04", {"fp16": FP32, "int8": INT8_FP32}, {"fp16": 0.86, "int8": 0.80})


def judged(report, mode, card):
    return judge_mode(report, QualityPolicy(), "general", mode, card)


# ---------------------------------------------------------------------------------------------- the verdict
def test_a_mode_is_judged_by_the_row_scored_on_its_kernels_and_is_pending_without_one():
    report = merged(None, BF16_RUN)
    pending = judged(report, "int8", INT8_FP32)
    assert (pending.status, pending.run, pending.scored_on["compute"]) == ("pending", None, "bfloat16")
    assert pending.detail == ("gate pending: its rows were scored on other kernels "
                              "(compute bfloat16 there, float32 here)")
    assert judged(report, "int8", INT8_BF16).status == "pass"  # on a bf16 machine the row holds
    both = merged(report, FP32_RUN)
    assert judged(both, "int8", INT8_FP32).status == "fail" and judged(both, "int8", INT8_FP32).run is both["runs"][1]
    assert judged(both, "int8", INT8_BF16).status == "pass"  # each machine class by its own run
    assert judged(both, "gptq", INT8_FP32) is None  # no row at all: as the policy's require_gate says


def test_the_reference_passes_on_any_kernels_and_an_engine_that_cannot_say_takes_the_newest_row():
    report = merged(None, BF16_RUN)
    reference = judged(report, REFERENCE_MODE, FP32)
    assert (reference.status, reference.scored_on["compute"]) == ("pass", "bfloat16")
    assert judged(merged(report, FP32_RUN), "int8", None).status == "fail"  # newest run, as mismatch() takes it
    unrecorded = {k: v for k, v in BF16_RUN.items() if k != "kernels"}
    assert judged(unrecorded, "int8", INT8_BF16).detail.endswith("(the row does not record them)")


def test_a_run_replaces_the_one_on_the_same_kernels_and_keeps_the_others():
    """The engine's name is no part of the kernels: the same machine scoring again with another engine layout
    replaces its run."""
    both = merged(merged(None, BF16_RUN), FP32_RUN)
    again = {**FP32_RUN, "date": "2026-12-05",
             "kernels": {m: {**c, "engine": "vllm:other"} for m, c in FP32_RUN["kernels"].items()}}
    report = merged(both, again)
    assert [r["date"] for r in runs(report)] == ["2026-12-03", "2026-12-05"]
    assert (report["model"], report["backend"]) == ("demo", "vllm")
    sections = render(report)
    assert sections.count("# Quality gate: demo on vllm, reference ") == 2
    assert "reference float32 x float32 (float32), oneDNN matmul (2026-12-05)" in sections
    assert runs(BF16_RUN) == [BF16_RUN]  # a report of one run, as written before runs


# ---------------------------------------------------------------------------------------------- the controller
POLICY = "rules: []\ndefault: [int8, fp16]\n"


def controller(text: str = POLICY, report=None, int8=INT8_FP32) -> Controller:
    ctl = Controller({"fp16": Mode("fp16", kernels=FP32), "int8": Mode("int8", kernels=int8)}, policy_from(text))
    ctl.quality_report = report if report is not None else merged(None, BF16_RUN)
    return ctl


def test_a_pending_mode_is_never_chosen_unpinned_and_is_served_pinned_with_the_reason():
    ctl = controller()
    decision = ctl.decide(feats())
    assert decision.mode == "fp16" and decision.filtered["int8"].code is Code.GATE_PENDING
    assert "int8: gate pending: its rows were scored on other kernels" in decision.reason
    assert decision.gate_pending == ""
    pinned = ctl.decide(feats(), pinned="int8")
    assert (pinned.mode, pinned.rule) == ("int8", "pinned-gate-pending")
    assert pinned.gate_pending.startswith("gate pending: ") and pinned.gate_pending in pinned.reason
    assert controller(int8=INT8_BF16).decide(feats()).mode == "int8"  # scored on its kernels: it passes


def test_when_only_pending_modes_are_the_policys_a_mode_the_gate_passed_stands_in():
    decision = controller("rules: []\ndefault: [int8]\n").decide(feats())
    assert (decision.mode, decision.rule) == ("fp16", "while-gate-pending")


def test_require_gate_refuses_a_pending_mode_even_pinned_and_no_report_makes_nothing_pending():
    strict = controller(POLICY + "quality: {require_gate: true}\n")
    with pytest.raises(NoEligibleMode, match=r"gate pending: .* \(require_gate\)") as refused:
        strict.decide(feats(), pinned="int8")
    assert refused.value.code is Code.QUALITY
    off = controller()
    off.quality_report = None  # --gate-report none: the gate is off, every mode as its policy says
    assert off.decide(feats()).mode == "int8"


# ---------------------------------------------------------------------------------------------- the API
def test_v1_modes_and_the_answer_say_the_gate_is_pending(make_app, tmp_path):
    app = make_app(modes=("fp16", "int8"), policy="name: t\nrules: []\ndefault: [int8, fp16]\n",
                   kernels={"fp16": FP32, "int8": INT8_FP32})
    path = tmp_path / "demo-vllm.json"
    path.write_text(json.dumps(merged(None, BF16_RUN)))
    app.service.controller.load_quality_report(path)
    listed = app.modes()
    assert listed["int8"]["quality_gate"].startswith("gate pending: its rows were scored on other kernels")
    row = listed["int8"]["gate_row"]
    assert (row["run"], row["same_kernels"], row["scored_on"]["compute"]) == (None, False, "bfloat16")
    assert listed["fp16"]["quality_gate"] == "pass" and listed["fp16"]["gate_row"]["same_kernels"] is False
    gate = app.get("/v1/modes").get_json()["quality_gate"]
    assert gate["runs"] == [{"date": "2026-12-03", "reference": "bfloat16 x bfloat16 (bfloat16), oneDNN matmul"}]
    served = app.complete("Hello")["modeswitch"]
    assert served["mode"] == "fp16" and "quality_gate" not in served
    pinned = app.complete("Hello", mode="int8")["modeswitch"]
    assert pinned["mode"] == "int8" and pinned["quality_gate"]["status"] == "pending"
    assert pinned["quality_gate"]["reason"].startswith("gate pending: ")
    counted = app.get("/metrics").get_data(as_text=True)  # the answers no verdict vouched for, by their rule
    assert 'modeswitch_decisions_total{mode="int8",rule="pinned-gate-pending"} 1.0' in counted
    path.write_text(json.dumps(merged(merged(None, BF16_RUN), FP32_RUN)))
    reloaded = app.post("/admin/gate").get_json()
    assert reloaded["runs"] == 2 and reloaded["date"] == "2026-12-04"
    assert app.modes()["int8"]["quality_gate"] == "fails the quality gate (cloze -6.0 pp)"
    refused = app.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "mode": "int8"})
    assert refused.status_code == 400 and refused.get_json()["error"]["code"] == "mode_unavailable"


# ---------------------------------------------------------------------------------------------- scoring here
def test_traffic_without_a_quiet_gap_slows_the_scorer_to_its_share_of_the_time(make_app):
    """Requests back to back, never a quiet gap: the scorer still sends, after waiting (1 - share) / share times as
    long as its last request took (share 0.5 here: as long), the first as if it had taken the quiet period."""
    import threading

    from modeswitch.evals.behind import PendingScorer
    from modeswitch.testing.engine import Script

    app = make_app(modes=("fp16",), scripts={"fp16": Script(token_s=0.02)})
    url, stop = app.serve(), threading.Event()

    def traffic():
        while not stop.is_set():
            requests.post(url + "/v1/completions", timeout=30,
                          json={"prompt": "Hello", "max_tokens": 10, "temperature": 0, "mode": "fp16"})

    scorer = PendingScorer(app.service, app.assembled.admission.idle_s, quiet_s=0.5, busy_share=0.5,
                           progress=lambda line: None)
    sender = threading.Thread(target=traffic)
    sender.start()
    try:
        time.sleep(0.3)
        waited = time.perf_counter()
        scorer.wait_quiet()  # no gap of 0.5 s comes: sent after 0.5 s
        first = time.perf_counter() - waited
        time.sleep(0.3)  # its request took 0.3 s
        waited = time.perf_counter()
        scorer.wait_quiet()
        second = time.perf_counter() - waited
        assert app.assembled.admission.idle_s() < 0.5  # the traffic never paused
    finally:
        stop.set()
        sender.join()
    assert 0.45 < first < 1.5 and 0.25 < second < 1.2, (first, second)


def test_the_server_scores_its_pending_modes_behind_the_requests_and_keeps_the_run(make_app, tmp_path):
    """The scorer runs lm-eval (one cloze task, 4 documents) on the pending mode and the reference through the
    server's own service, sends nothing until the server has been quiet a while, keeps the run under the report's
    name in the cache, and the verdict replaces pending; the next load of the report reads the cached run."""
    from concurrent.futures import ThreadPoolExecutor

    from modeswitch.evals.behind import PendingScorer
    from modeswitch.testing.engine import Script

    app = make_app(modes=("fp16", "int8"), kernels={"fp16": FP32, "int8": INT8_FP32},
                   scripts={"fp16": Script(token_s=0.05)})
    shipped = tmp_path / "demo-vllm.json"
    shipped.write_text(json.dumps(merged(None, BF16_RUN)))
    controller = app.service.controller
    controller.quality_cache = tmp_path / "cache"
    controller.load_quality_report(shipped)
    scorer = PendingScorer(app.service, app.assembled.admission.idle_s, tasks=("jargon_cloze",), limit=4,
                           quiet_s=0.3, progress=lambda line: None)
    assert scorer.pending() == ["int8"]
    url = app.serve()  # over real HTTP, where a request's admission ticket is returned once it is answered
    with ThreadPoolExecutor(1) as pool:  # a request in flight: nothing is sent until it ended 0.3 s ago
        busy = pool.submit(requests.post, url + "/v1/completions", timeout=30,
                           json={"prompt": "Hello", "max_tokens": 20, "temperature": 0, "mode": "fp16"})
        wait_for(lambda: app.assembled.admission.active, 10, every=0.01)
        waited = time.perf_counter()
        scorer.wait_quiet()  # 20 tokens at 50 ms each: about a second, then 0.3 s of quiet
        assert busy.done() and busy.result().json()["modeswitch"]["mode"] == "fp16"
        assert time.perf_counter() - waited > 0.3 + 0.3 and app.assembled.admission.idle_s() >= 0.3
    run = scorer.run()
    assert 0 <= scorer.longest_s < 1  # the fake engine scores a prompt at once
    assert set(run["modes"]) == {"fp16", "int8"} and run["kernels"]["int8"]["compute"] == "float32"
    assert len(run["documents"]["int8"]["jargon_cloze"]) == 4
    kept = json.loads((tmp_path / "cache" / "demo-vllm.json").read_text())
    assert [r["date"] for r in runs(kept)] == [run["date"]]
    assert scorer.pending() == [] and app.modes()["int8"]["gate_row"]["same_kernels"] is True
    controller.load_quality_report(shipped)  # as the next start reads it: the shipped runs, then the cached one
    assert len(runs(controller.quality_report)) == 2 and scorer.pending() == []
