"""The decision pipeline for one request: gates filter modes, the policy chooses, the reason is recorded.

The controller holds the current policy behind one reference: a reload parses and validates the new
file completely first and swaps the reference only on success, so a broken file never replaces a
working policy and requests in progress keep the policy they started with.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..registry import ModeRegistry
from .features import Features
from ..yamlconf import ConfigError
from .gates import DEFAULT_GATES, EnergyGate, Gate, MemoryGate, QualityGate
from .rules import RulePolicy, load_policy


class NoEligibleMode(RuntimeError):
    """Every mode the policy could use is filtered. ``code`` says why, and so whether waiting would help:
    ``saturated``, ``quarantined`` or ``memory`` (temporary), ``unavailable`` (not for this request / not here)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _code(reasons: list[str]) -> str:
    """The most hopeful reason among the gates' answers: waiting helps for saturation and quarantine."""
    for prefix, code in (("saturated", "saturated"), ("quarantined", "quarantined"), ("memory pressure", "memory")):
        if any(r.startswith(prefix) for r in reasons):
            return code
    return "unavailable"


@dataclass(frozen=True)
class Decision:
    mode: str
    reason: str
    features: Features
    filtered: Mapping[str, str] = field(default_factory=dict)
    policy: str = ""
    decision_us: float = 0.0
    rule: str = ""  # the rule that matched, "default", or "pinned" (a low-cardinality metrics label)
    prediction: Mapping | None = None  # a learned policy's expectation for the chosen mode


class Controller:
    def __init__(self, pool: ModeRegistry, policy: RulePolicy, gates: Sequence[Gate] = DEFAULT_GATES,
                 defined_modes: Sequence[str] = ()) -> None:
        """``defined_modes``: every mode a policy may name, loaded or not (``--modes`` loads a subset)."""
        self.pool = pool
        self.policy = policy
        self.quality_report: dict | None = None
        self.quality_report_path: Path | None = None
        self.gates = (*gates, QualityGate(self), MemoryGate(self), EnergyGate(self))
        self.defined_modes = tuple(dict.fromkeys([*defined_modes, *pool.modes]))
        self._not_loaded = {m: "not loaded (--modes)" for m in self.defined_modes if m not in pool.modes}
        self._reload_lock = threading.Lock()

    def filter(self, features: Features, exclude: frozenset[str] = frozenset()) -> dict[str, str]:
        """Modes a gate rejects for this request, with the first gate's reason."""
        filtered: dict[str, str] = dict(self._not_loaded)
        for name, state in self.pool.modes.items():
            if name in exclude:
                filtered[name] = "excluded after a failed attempt"
                continue
            for gate in self.gates:
                why = gate.check(state, features)
                if why is not None:
                    filtered[name] = why
                    break
        return filtered

    def decide(self, features: Features, pinned: str | None = None, exclude: frozenset[str] = frozenset()) -> Decision:
        start = time.perf_counter()
        policy = self.policy
        filtered = self.filter(features, exclude)
        if pinned is not None:
            if pinned in filtered:
                raise NoEligibleMode(f"pinned mode {pinned!r} cannot serve this request: {filtered[pinned]}",
                                     _code([filtered[pinned]]))
            mode, reason, rule, prediction = pinned, "pinned by the request", "pinned", None
        else:
            choice = policy.choose(features, filtered)
            if choice.mode is None and (spare := self._degrade(features, filtered)) is not None:
                prediction = None
                mode, reason, rule = spare, f"policy {policy.name}: {choice.reason}; memory pressure: degraded to " \
                                            f"{spare} (its KV is reserved at start)", "memory-degrade"
            elif choice.mode is None:
                raise NoEligibleMode(choice.reason, _code(list(filtered.values())))
            else:
                mode, reason, rule = choice.mode, f"policy {policy.name}: {choice.reason}", choice.rule or "default"
                prediction = choice.prediction
        elapsed = (time.perf_counter() - start) * 1e6
        return Decision(mode, reason, features, filtered, policy.name, elapsed, rule, prediction)

    def observe(self, mode: str, features: Features, ttft_s: float, tpot_s: float | None,
                energy_j: float | None) -> None:
        """A request finished well in ``mode``: a learning policy updates its predictors."""
        observe = getattr(self.policy, "observe", None)
        if observe is not None:
            observe(mode, features, ttft_s, tpot_s, energy_j)

    def close(self) -> None:
        """Persist a learning policy's state (server shutdown)."""
        save = getattr(self.policy, "save", None)
        if save is not None:
            save()

    def _degrade(self, features: Features, filtered: Mapping[str, str]) -> str | None:
        """Under memory pressure, when the policy's own modes are all filtered, any mode that passed every
        gate (the memory gate lets only preallocated-KV modes through) rather than an error."""
        if features.memory_headroom >= self.policy.memory.min_headroom:
            return None
        return next((name for name in self.pool.modes if name not in filtered), None)

    def load_quality_report(self, path: str | Path | None = None) -> dict | None:
        """Read the gate report (default: the one loaded before); a missing or broken file changes nothing."""
        path = Path(path) if path else self.quality_report_path
        if path is None:
            raise ConfigError("no quality gate report configured (--gate-report)")
        try:
            report = json.loads(Path(path).read_text())
            if not isinstance(report.get("modes"), dict) or "fp16" not in report["modes"]:
                raise ValueError("it has no fp16 reference results")
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{path}: not a quality gate report: {exc}") from None
        self.quality_report, self.quality_report_path = report, path
        return report

    def reload(self, path: str | Path | None = None) -> RulePolicy:
        """Load ``path`` (default: the current policy's file) and switch to it; on any error keep the old one."""
        with self._reload_lock:
            self.close()  # a learning policy's state is saved first, so reloading its own file keeps what it learned
            new = load_policy(path or self.policy.source, self.defined_modes)
            self.policy = new
            return new
