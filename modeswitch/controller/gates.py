"""Gates: filters that remove modes a request must not go to, each answering with a typed verdict.

A gate answers ``None`` (pass) or a :class:`Verdict`. The controller applies them all before the policy
chooses, so a policy can never route around one. The policy-driven gates (quality, energy, memory) read
the controller's current policy on every check, so a reloaded policy applies to the next request.
"""

from __future__ import annotations

from typing import Protocol

from ..pool import ModeState
from .features import Features
from .quality import judge
from .verdicts import Code, Verdict


class Gate(Protocol):
    name: str

    def check(self, mode: ModeState, features: Features) -> Verdict | None: ...


class AvailableGate:
    """The mode was built and warmed up."""

    name = "available"

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        return None if mode.available else Verdict(Code.UNAVAILABLE, f"unavailable: {mode.reason}")


class CapacityGate:
    """The mode's bounded queue has room; when every mode is full, waiting helps."""

    name = "capacity"

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        if mode.engine is not None and mode.engine.in_flight >= mode.engine.max_queue:
            return Verdict(Code.SATURATED, f"saturated: {mode.engine.in_flight}/{mode.engine.max_queue} in flight")
        return None


_GREEDY_ONLY = Verdict(Code.CAPABILITY, "serves greedy requests only (temperature 0)")
_NO_SCORING = Verdict(Code.CAPABILITY, "cannot return prompt logprobs")


class CapabilityGate:
    """The mode can honour the request's decoding settings (e.g. sampling on a greedy-only engine)."""

    name = "capability"

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        if mode.engine is None:
            return None
        if not features.greedy and not mode.engine.supports_sampling:
            return _GREEDY_ONLY
        if features.scoring and not mode.engine.supports_scoring:
            return _NO_SCORING
        return None


class QuarantineGate:
    """The mode has not failed a request recently (see ModeState.record_failure for the backoff)."""

    name = "quarantine"

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        left = mode.quarantine_left
        if left > 0:
            return Verdict(Code.QUARANTINED, f"quarantined for {left:.0f} s after: {mode.last_error}")
        return None


_NO_REPORT = Verdict(Code.QUALITY, "no quality gate report (require_gate)")
_NOT_IN_REPORT = Verdict(Code.QUALITY, "not in the quality gate report (require_gate)")


class QualityGate:
    """The mode's accuracy delta vs fp16, from the gate report, is within the policy's tolerance for the
    request's task family. Verdicts are computed once per (report, policy, family) and then looked up."""

    name = "quality"

    def __init__(self, controller) -> None:
        self.controller = controller
        self._verdicts: dict = {}

    def verdicts(self, family: str) -> dict[str, Verdict | None]:
        report, policy = self.controller.quality_report, self.controller.policy
        key = (id(report), id(policy), family)
        if key not in self._verdicts:
            judged = judge(report, policy.quality, family)
            self._verdicts = {key: {mode: None if why is None else Verdict(Code.QUALITY, why)
                                    for mode, why in judged.items()}}  # older keys are stale
        return self._verdicts[key]

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        quality = self.controller.policy.quality
        report = self.controller.quality_report
        if report is None:
            return _NO_REPORT if quality.require_gate else None
        verdicts = self.verdicts(features.task)
        if mode.name not in verdicts:
            return _NOT_IN_REPORT if quality.require_gate else None
        return verdicts[mode.name]


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

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        if mode.j_per_token is None:
            return None
        policy = self.controller.policy
        cap = policy.energy.cap(mode.name, self._rule(policy, features))
        if cap is not None and mode.j_per_token > cap[0]:
            return Verdict(Code.ENERGY, f"energy: {mode.j_per_token:.4g} J/token over the cap of {cap[0]:g} ({cap[1]})")
        return None


class MemoryGate:
    """Under memory pressure (free fraction below the policy's ``memory.min_headroom``), only modes whose
    KV is reserved at start take new requests: the others would allocate the request's KV now."""

    name = "memory"

    def __init__(self, controller) -> None:
        self.controller = controller

    def check(self, mode: ModeState, features: Features) -> Verdict | None:
        floor = self.controller.policy.memory.min_headroom
        if features.memory_headroom >= floor or mode.engine is None or mode.engine.preallocated_kv:
            return None
        shape = self.controller.pool.shape
        need = shape.kv_bytes_per_token * (features.prompt_tokens + features.max_tokens) if shape else 0
        return Verdict(Code.MEMORY, f"memory pressure: {features.memory_headroom:.1%} free < {floor:.1%}, and this "
                                    f"mode would allocate ~{need / 2**20:.1f} MiB of KV for the request")


DEFAULT_GATES: tuple[Gate, ...] = (AvailableGate(), QuarantineGate(), CapabilityGate(), CapacityGate())
