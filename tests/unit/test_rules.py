"""Rule policies: validation errors name file, line and field; first match wins; gated modes fall through."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeswitch.config import LoadConfig
from modeswitch.controller.load import load_policy
from modeswitch.controller.verdicts import Code, Verdict
from modeswitch.modes import load_modes
from modeswitch.yamlconf import ConfigError
from policy_text import MODES, feats, policy_from, shipped_run

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_policies_load():
    for path in sorted((ROOT / "policies").glob("*.yaml")):
        policy = load_policy(path, MODES)
        assert policy.describe()["type"] == ("learned" if path.stem == "learned" else "rules")
        assert getattr(policy, "default", None) or getattr(policy, "modes", None)


@pytest.mark.parametrize("text, where, fragment", [
    ("rules: []\ndefault: fp17\n", "p.yaml:2", "unknown mode 'fp17'"),
    ("rules:\n  - when: {queue_depth: {gte: 4}}\n    use: fp16\ndefault: fp16\n", "p.yaml:2", "gte"),
    ("rules:\n  - when: {queue_depth: {ge: four}}\n    use: fp16\ndefault: fp16\n", "p.yaml:2", "expected a number"),
    ("rules:\n  - use: fp16\n    when:\n      depth: {ge: 1}\ndefault: fp16\n", "p.yaml:4", "unknown feature"),
    ("rules: []\n", "p.yaml", "default: is required"),
    ("rules: []\ndefault: fp16\ncolour: red\n", "p.yaml:3", "colour: unknown field"),
    ("rules: [\n", "p.yaml:2", "invalid YAML"),
    ("- just\n- a list\n", "p.yaml", "expected a mapping"),
])
def test_invalid_policies_are_rejected_with_their_location(text, where, fragment):
    with pytest.raises(ConfigError) as exc:
        policy_from(text)
    assert where in str(exc.value) and fragment in str(exc.value)


def test_first_matching_rule_wins_and_gates_decide_among_its_modes():
    policy = load_policy(ROOT / "policies" / "paper.yaml", MODES)
    # Nothing filtered: the shared-prefix rule's first choice.
    choice = policy.choose(feats(prefix_match_tokens=90, prefix_match_ratio=0.9), {})
    assert choice.mode == "gptq+prefix_cache" and choice.rule == "shared-prefix"
    # Its first choice gated: the next in the rule's list, with the skip explained.
    choice = policy.choose(feats(prefix_match_tokens=90, prefix_match_ratio=0.9), {"gptq+prefix_cache": "unavailable: x"})
    assert choice.mode == "prefix_cache" and "skipped gptq+prefix_cache: unavailable: x" in choice.reason
    # Earlier rules win: concurrency beats shared prefix.
    assert policy.choose(feats(queue_depth=5, prefix_match_tokens=90, prefix_match_ratio=0.9), {}).rule == "many-concurrent"
    # Both conditions of a rule must hold.
    assert policy.choose(feats(prompt_tokens=100, max_tokens=64), {}).rule is None
    assert policy.choose(feats(prompt_tokens=100, max_tokens=200), {}).mode == "speculative"
    # Everything in the rule's list gated: the policy's fallback.
    choice = policy.choose(feats(max_tokens=200), {"speculative": "saturated: 8/8 in flight"})
    assert choice.mode == "fp16" and "(fallback)" in choice.reason
    # Nothing left at all.
    choice = policy.choose(feats(), {m: "unavailable" for m in MODES})
    assert choice.mode is None and "no eligible mode" in choice.reason


def test_prefer_prefix_match_orders_a_rules_modes_by_what_each_holds():
    policy = policy_from("rules:\n  - when: {prefix_match_tokens: {ge: 10}}\n    use: [gptq+prefix_cache, prefix_cache]\n"
                         "    prefer: prefix_match\ndefault: fp16\n")
    held_by_fp16 = feats(prefix_match_tokens=50, prefix_match_by_mode={"prefix_cache": 50, "gptq+prefix_cache": 3})
    assert policy.choose(held_by_fp16, {}).mode == "prefix_cache"
    both = feats(prefix_match_tokens=50, prefix_match_by_mode={"prefix_cache": 50, "gptq+prefix_cache": 50})
    assert policy.choose(both, {}).mode == "gptq+prefix_cache"  # a tie keeps the file's order
    assert policy.choose(held_by_fp16, {"prefix_cache": "saturated: 8/8"}).mode == "gptq+prefix_cache"
    with pytest.raises(ConfigError, match="prefer: must be one of prefix_match"):
        policy_from("rules:\n  - use: fp16\n    prefer: speed\ndefault: fp16\n")


def test_a_policy_may_name_modes_left_out_by_dash_dash_modes():
    """paper.yaml names all 8 modes; serving a subset must keep it valid and route among what is loaded."""
    from modeswitch.controller.decide import Controller
    from modeswitch.weights.presets import PRESETS
    from modeswitch.serving.registry import ModeRegistry

    modes = load_modes()
    served = [m for m in modes if m.name in ("fp16", "prefix_cache")]
    pool = ModeRegistry(PRESETS["demo"], served, LoadConfig(backend="transformers", device="cpu"))
    for state in pool.modes.values():
        state.status = "available"  # as after a successful load (no engines needed to decide)
    policy = load_policy(ROOT / "policies" / "paper.yaml", [m.name for m in modes])
    controller = Controller(pool.modes, policy, defined_modes=[m.name for m in modes])
    decision = controller.decide(feats(queue_depth=9))  # many-concurrent: neither CB mode is loaded
    assert decision.mode == "fp16"
    assert decision.filtered["continuous_batching"] == Verdict(Code.NOT_LOADED, "not loaded (--modes)")
    assert "continuous_batching: not loaded (--modes)" in decision.reason


def test_quality_gate_uses_the_policy_tolerance_family_and_require_gate():
    from modeswitch.controller.decide import Controller
    from modeswitch.weights.presets import PRESETS
    from modeswitch.serving.registry import ModeRegistry

    modes = [m for m in load_modes() if m.name in ("fp16", "gptq", "int8")]
    pool = ModeRegistry(PRESETS["demo"], modes, LoadConfig(backend="transformers", device="cpu"))
    for state in pool.modes.values():
        state.status = "available"
    report = {"tasks": {"cloze": {"higher_is_better": True}, "ppl": {"higher_is_better": False}},
              "modes": {"fp16": {"cloze": {"value": 0.80}, "ppl": {"value": 100.0}},
                        "gptq": {"cloze": {"value": 0.79}, "ppl": {"value": 140.0}}}}
    text = ("rules: []\ndefault: [gptq, int8, fp16]\nquality: {max_drop_pp: 2, max_ppl_increase_pct: 10, "
            "families: {cloze_only: [cloze]}}\n")
    controller = Controller(pool.modes, policy_from(text))
    controller.quality_report = report
    general = controller.decide(feats())
    assert general.mode == "int8"  # gptq fails on perplexity (+40 %); int8 is not in the report: allowed
    assert "gptq: fails the quality gate (ppl +40.0 %)" in general.reason
    assert controller.decide(feats(task="cloze_only")).mode == "gptq"  # -1 pp on cloze is within 2 pp
    strict = policy_from(text.replace("max_drop_pp: 2", "max_drop_pp: 2, require_gate: true"))
    controller.policy = strict
    assert controller.decide(feats(task="cloze_only")).mode == "gptq"
    decision = controller.decide(feats())
    assert decision.mode == "fp16" and "int8: not in the quality gate report (require_gate)" in decision.reason
    controller.quality_report = None
    with pytest.raises(Exception, match="no quality gate report"):
        controller.decide(feats())


def test_batch_first_batches_int8_first_and_falls_back_to_the_reference_weights_where_the_gate_fails_int8():
    """batch-first.yaml with the shipped vLLM gate report: int8 batched, int8 reading the cache on a shared prefix;
    with a report in which int8 fails, the same requests go to the reference weights' batched and prefix modes."""
    from modeswitch.controller.decide import Controller
    from modeswitch.weights.presets import PRESETS
    from modeswitch.serving.registry import ModeRegistry
    from modeswitch.resources import POLICIES_DIR

    modes = load_modes()
    pool = ModeRegistry(PRESETS["demo"], modes, LoadConfig(backend="transformers", device="cpu"))
    for state in pool.modes.values():
        state.status = "available"
    controller = Controller(pool.modes, load_policy(POLICIES_DIR / "batch-first.yaml", MODES))
    report = shipped_run()
    controller.quality_report = report
    shared = feats(prefix_match_tokens=200, prefix_match_ratio=0.8,
                   prefix_match_by_mode={"int8+prefix_cache": 200, "prefix_cache": 200})
    assert controller.decide(feats()).mode == "int8+continuous_batching"
    assert controller.decide(shared).mode == "int8+prefix_cache"
    in_the_batch = controller.decide(feats(prefix_cache_batched=1))  # vLLM: every request reads the cache
    assert (in_the_batch.mode, in_the_batch.rule) == ("int8+prefix_cache", "prefix-cache-in-the-batch")
    held_by_fp16 = feats(prefix_cache_batched=1, prefix_match_tokens=128, prefix_match_ratio=0.4,
                         prefix_match_by_mode={"int8+prefix_cache": 0, "prefix_cache": 128})
    assert controller.decide(held_by_fp16).mode == "prefix_cache"  # one block of a prompt is still read
    pressed = controller.decide(feats(memory_headroom=0.05))  # the demo's GPTQ fails the gate: int8 then
    assert pressed.mode == "int8" and "gptq: fails the quality gate" in pressed.reason
    reserved = controller.decide(feats(memory_headroom=0.05, prefix_cache_batched=1))  # vLLM's KV: reserved at start
    assert (reserved.mode, reserved.rule) == ("int8+prefix_cache", "prefix-cache-in-the-batch")
    int8_fails = {mode: report["modes"]["gptq"] for mode in ("int8", "int8+continuous_batching", "int8+prefix_cache")}
    controller.quality_report = {**report, "modes": {**report["modes"], **int8_fails}}  # int8 as bad as GPTQ
    assert controller.decide(feats()).mode == "continuous_batching"
    assert controller.decide(shared).mode == "prefix_cache"
    assert controller.decide(feats(prefix_cache_batched=1)).mode == "prefix_cache"


def test_a_drop_of_exactly_the_tolerance_passes_despite_floating_point():
    """One document of 100 (0.97 -> 0.96) is a 1.0 pp drop, which a 1.0 pp tolerance allows; 2 are not; a number
    that is not one still fails."""
    from modeswitch.controller.quality import QualityPolicy, task_failure

    quality = QualityPolicy(max_drop_pp=1.0, max_ppl_increase_pct=10.0)
    assert task_failure("copy", 0.96, 0.97, True, quality) is None
    assert task_failure("copy", 0.95, 0.97, True, quality) == "copy -2.0 pp"
    assert task_failure("ppl", 110.0, 100.0, False, quality) is None
    assert task_failure("copy", float("nan"), 0.97, True, quality) is not None
