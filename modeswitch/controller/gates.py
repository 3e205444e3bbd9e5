"""Gates: filters that remove modes a request must not go to, each with the reason it gives.

A gate answers ``None`` (pass) or a short reason. The controller applies them all before the policy
chooses, so a policy can never route around one. The policy-driven gates (quality, energy, memory) read
the controller's current policy on every check, so a reloaded policy applies to the next request.
"""

from __future__ import annotations

from typing import Protocol

from ..registry import ModeState
from .features import Features


class Gate(Protocol):
    name: str

    def check(self, mode: ModeState, features: Features) -> str | None: ...


class AvailableGate:
    """The mode was built and warmed up."""

    name = "available"

    def check(self, mode: ModeState, features: Features) -> str | None:
        return None if mode.available else f"unavailable: {mode.reason}"


class CapacityGate:
    """The mode's bounded queue has room; full queues are what turns into 503 when every mode is full."""

    name = "capacity"

    def check(self, mode: ModeState, features: Features) -> str | None:
        if mode.engine is not None and mode.engine.in_flight >= mode.engine.max_queue:
            return f"saturated: {mode.engine.in_flight}/{mode.engine.max_queue} in flight"
        return None


class CapabilityGate:
    """The mode can honour the request's decoding settings (e.g. sampling on a greedy-only engine)."""

    name = "capability"

    def check(self, mode: ModeState, features: Features) -> str | None:
        if mode.engine is None:
            return None
        if not features.greedy and not mode.engine.supports_sampling:
            return "serves greedy requests only (temperature 0)"
        if features.scoring and not mode.engine.supports_scoring:
            return "cannot return prompt logprobs"
        return None


class QuarantineGate:
    """The mode has not failed a request recently (see ModeState.record_failure for the backoff)."""

    name = "quarantine"

    def check(self, mode: ModeState, features: Features) -> str | None:
        left = mode.quarantine_left
        if left > 0:
            return f"quarantined for {left:.0f} s after: {mode.last_error}"
        return None


class QualityGate:
    """The mode's accuracy delta vs fp16, from the gate report, is within the policy's tolerance for the
    request's task family. Verdicts are computed once per (report, policy, family) and then looked up."""

    name = "quality"

    def __init__(self, controller) -> None:
        self.controller = controller
        self._verdicts: dict = {}

    def verdicts(self, family: str) -> dict[str, str | None]:
        report, policy = self.controller.quality_report, self.controller.policy
        key = (id(report), id(policy), family)
        if key not in self._verdicts:
            self._verdicts = {key: judge(report, policy.quality, family)}  # older keys are stale
        return self._verdicts[key]

    def check(self, mode: ModeState, features: Features) -> str | None:
        quality = self.controller.policy.quality
        report = self.controller.quality_report
        if report is None:
            return "no quality gate report (require_gate)" if quality.require_gate else None
        verdict = self.verdicts(features.task).get(mode.name, "missing")
        if verdict == "missing":
            return "not in the quality gate report (require_gate)" if quality.require_gate else None
        return verdict


class EnergyGate:
    """The mode's running J per generated token (measured or estimated, see ``modeswitch.energy``) is within
    the tightest cap that applies: the policy's, the mode's own, the matching rule's. A mode that has not
    finished a request yet has no figure and passes: it cannot be judged before it has been tried.
    The matching rule is found once per request, not once per mode (the controller checks every mode
    with the same features object)."""

    name = "energy"

    def __init__(self, controller) -> None:
        self.controller = controller
        self._last_match: tuple = (None, None, None)  # (policy, features, rule); swapped whole, so thread-safe

    def _rule(self, policy, features: Features):
        last_policy, last_features, rule = self._last_match
        if last_policy is not policy or last_features is not features:
            rule = policy.match(features)
            self._last_match = (policy, features, rule)
        return rule

    def check(self, mode: ModeState, features: Features) -> str | None:
        if mode.j_per_token is None:
            return None
        policy = self.controller.policy
        cap = policy.energy.cap(mode.name, self._rule(policy, features))
        if cap is not None and mode.j_per_token > cap[0]:
            return f"energy: {mode.j_per_token:.4g} J/token over the cap of {cap[0]:g} ({cap[1]})"
        return None


class MemoryGate:
    """Under memory pressure (free fraction below the policy's ``memory.min_headroom``), only modes whose
    KV is reserved at start take new requests: the others would allocate the request's KV now."""

    name = "memory"

    def __init__(self, controller) -> None:
        self.controller = controller

    def check(self, mode: ModeState, features: Features) -> str | None:
        floor = self.controller.policy.memory.min_headroom
        if features.memory_headroom >= floor or mode.engine is None or mode.engine.preallocated_kv:
            return None
        need = self.controller.pool.kv_bytes_per_token * (features.prompt_tokens + features.max_tokens)
        return (f"memory pressure: {features.memory_headroom:.1%} free < {floor:.1%}, and this mode would "
                f"allocate ~{need / 2**20:.1f} MiB of KV for the request")


def judge(report: dict | None, quality, family: str) -> dict[str, str | None]:
    """Per mode in the report: None if it passes for ``family``, else why it fails."""
    if report is None:
        return {}
    base = report["modes"].get("fp16", {})
    tasks = [t for t in quality.tasks_for(family, report["tasks"]) if t in report["tasks"]]
    verdicts: dict[str, str | None] = {}
    for mode, per_task in report["modes"].items():
        failures = []
        for task in tasks:
            if task not in per_task or task not in base:
                continue
            value, ref = per_task[task]["value"], base[task]["value"]
            if report["tasks"][task]["higher_is_better"]:
                drop = (ref - value) * 100
                if drop > quality.max_drop_pp:
                    failures.append(f"{task} -{drop:.1f} pp")
            elif (value / ref - 1) * 100 > quality.max_ppl_increase_pct:
                failures.append(f"{task} +{(value / ref - 1) * 100:.1f} %")
        verdicts[mode] = f"fails the quality gate ({', '.join(failures)})" if failures else None
    return verdicts


DEFAULT_GATES: tuple[Gate, ...] = (AvailableGate(), QuarantineGate(), CapabilityGate(), CapacityGate())
