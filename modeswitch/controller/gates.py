"""Gates: filters that remove modes a request must not go to, each with the reason it gives.

A gate answers ``None`` (pass) or a short reason. The controller applies them all before the policy
chooses, so a policy can never route around one. Quality, energy and memory gates join this list
in later issues; the interface stays the same.
"""

from __future__ import annotations

from typing import Protocol

from ..pool import ModeState
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
        if not features.greedy and mode.engine is not None and not mode.engine.supports_sampling:
            return "serves greedy requests only (temperature 0)"
        return None


class QuarantineGate:
    """The mode has not failed a request recently (see ModeState.record_failure for the backoff)."""

    name = "quarantine"

    def check(self, mode: ModeState, features: Features) -> str | None:
        left = mode.quarantine_left
        if left > 0:
            return f"quarantined for {left:.0f} s after: {mode.last_error}"
        return None


DEFAULT_GATES: tuple[Gate, ...] = (AvailableGate(), QuarantineGate(), CapabilityGate(), CapacityGate())
