"""Gates: filters that remove modes a request must not go to, each answering with a typed verdict.

A gate passes a mode or stops it with a :class:`Verdict`. The controller applies them all before the policy
chooses, so a policy can never route around one: each gate in turn over the modes the gates before it passed (a
gate with nothing to ask of a request passes them all at once, as the memory gate does with no memory pressure).
The gates that depend on the policy (quality, memory, energy) read it from the :class:`Cycle`, the state of one
request's filtering: the policy and quality report as they were when the request was decided, so a reload applies
to the next request and never to half of this one's modes.

The *standing* gates come first (available, quarantine, quality): their verdicts read only a mode's standing
(available or loading, its quarantine, its engine's card) and the cycle's policy, report and task, not the request,
so the controller may keep them from one decision to the next until a mode's standing changes. The gates after
them ask what this request needs (options, queue room, memory, energy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol

from .features import Features
from .policy import Policy
from .quality import QualityPolicy, judge_mode
from .verdicts import Code, Verdict
from .view import ModeView


@dataclass(slots=True)
class Cycle:
    """One request's filtering: what every gate sees besides the mode (read, not changed: not frozen, as a frozen
    dataclass's construction costs a decision about a microsecond more)."""

    features: Features
    policy: Policy
    quality_report: Mapping | None


class Gate(Protocol):
    name: str
    #: its verdicts read only the modes' standing and the cycle's policy, report and task (see the module's
    #: docstring): kept until one of them changes
    standing: bool

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        """Of ``modes``, those it passes; each it stops goes into ``filtered`` with its verdict. The controller
        asks each gate once for every mode the gates before it passed (so a mode's verdict is its first gate's),
        and a gate with nothing to ask of this request passes them all without reading one."""


class _EachMode:
    """A gate that asks every mode: its ``check(mode, cycle)`` answers None (pass) or the verdict."""

    standing = False

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        passed = []
        for mode in modes:
            verdict = self.check(mode, cycle)  # type: ignore[attr-defined]
            if verdict is None:
                passed.append(mode)
            else:
                filtered[mode.name] = verdict
        return passed


_LOADING = Verdict(Code.LOADING, "loading: its engine starts after the server began serving")


class AvailableGate(_EachMode):
    """The mode was built and warmed up."""

    name = "available"
    standing = True

    def check(self, mode: ModeView, cycle: Cycle) -> Verdict | None:
        if mode.available:
            return None
        if mode.loading:  # built after the server began serving, or its engine being started again
            return Verdict(Code.LOADING, f"restarting: {mode.reason}") if mode.reason else _LOADING
        return Verdict(Code.UNAVAILABLE, f"unavailable: {mode.reason}")


class QuarantineGate:
    """The mode has not failed a request recently (the registry sets the backoff)."""

    name = "quarantine"
    standing = True

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        now = time.monotonic()  # once for every mode
        passed = []
        for mode in modes:
            until = mode.quarantined_until
            if until > now:
                filtered[mode.name] = Verdict(Code.QUARANTINED,
                                              f"quarantined for {until - now:.0f} s after: {mode.last_error}")
            else:
                passed.append(mode)
        return passed


class CapabilityGate(_EachMode):
    """The mode honours every request option the request sets (sampling on a greedy-only engine, prompt logprobs,
    a grammar on an engine that cannot constrain, ...): one that cannot is filtered, never chosen and then failed."""

    name = "capability"

    def __init__(self) -> None:
        self._verdicts: dict[frozenset[str], Verdict] = {}

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        if not cycle.features.needs:  # most requests set no option a mode may lack
            return modes
        return _EachMode.admit(self, modes, cycle, filtered)

    def check(self, mode: ModeView, cycle: Cycle) -> Verdict | None:
        missing = frozenset(cycle.features.needs) - mode.capabilities
        if not missing:
            return None
        if missing not in self._verdicts:  # a handful of distinct sets: built once each
            self._verdicts[missing] = Verdict(Code.CAPABILITY, f"cannot honour {', '.join(sorted(missing))}")
        return self._verdicts[missing]


class CapacityGate:
    """The mode's bounded queue has room; when every mode is full, waiting helps.

    It reads the requests in flight as the request's features count them (``in_flight_by_mode``, ``queue_depth``:
    read under the service's routing lock, so no request was routed since, unless the decision is a failed
    attempt's retry), as the policy's cost model does; with fewer in flight over all modes than the smallest bound,
    every queue has room and nothing is read at all. The modes' names and bounds are read once for each list of
    modes the gate is given (the controller keeps the standing gates' list between decisions, and a new engine
    changes the standing): a decision then reads no mode's properties here, with cold caches the larger part of its
    filtering. A mode filled all the same since (a retry's, or a request sent to its engine past the router)
    refuses the submission, and the decision is taken again without it."""

    name = "capacity"
    standing = False

    def __init__(self) -> None:
        #: the list of modes last given (held, so that its identity stays its own), each mode with its name and
        #: bound, and the smallest bound
        self._bounds: tuple[list[ModeView] | None, tuple[tuple[ModeView, str, int], ...], int] = (None, (), 0)

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        known, bounds, smallest = self._bounds
        if known is not modes:
            bounds = tuple((mode, mode.name, mode.max_queue) for mode in modes)
            smallest = min((bound for *_, bound in bounds), default=0)
            self._bounds = (modes, bounds, smallest)
        features = cycle.features
        if features.queue_depth < smallest:
            return modes
        counts = features.in_flight_by_mode
        passed = []
        for mode, name, bound in bounds:
            n = counts.get(name, 0)
            if n >= bound:
                filtered[name] = Verdict(Code.SATURATED, f"saturated: {n}/{bound} in flight")
            else:
                passed.append(mode)
        return passed


_NO_REPORT = Verdict(Code.QUALITY, "no quality gate report (require_gate)")
_NOT_IN_REPORT = Verdict(Code.QUALITY, "not in the quality gate report (require_gate)")


class QualityGate:
    """The mode's accuracy delta vs fp16, from the gate report's row scored on the kernels the mode serves on, is
    within the policy's tolerance for the request's task family. A mode whose rows were all scored on other kernels
    (another dtype, kernel or weight format: another machine's verdict) is pending: filtered with
    ``Code.GATE_PENDING``, which a request that pins the mode passes (the response says so); under ``require_gate``
    it is refused like a mode the report does not cover. Verdicts are computed once per (report, policy, family,
    mode, kernels) and then looked up."""

    name = "quality"
    standing = True

    def __init__(self) -> None:
        #: (report, policy, family) -> {mode: (the kernels card it was judged on, verdict)}, for the latest key only
        #: (older ones are stale); one tuple, swapped whole, so a thread deciding under an older key never writes
        #: into the newer cache
        self._cache: tuple[tuple, dict] = ((), {})

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        quality, report, task = cycle.policy.quality, cycle.quality_report, cycle.features.task
        if report is None:
            if not quality.require_gate:
                return modes
            filtered.update((mode.name, _NO_REPORT) for mode in modes)
            return []
        key = (id(report), id(cycle.policy), task)
        cached, verdicts = self._cache
        if cached != key:
            verdicts = {}
            self._cache = (key, verdicts)
        passed = []
        for mode in modes:
            name, card = mode.name, mode.kernels
            judged = verdicts.get(name)
            if judged is None or judged[0] is not card:  # a card is replaced, not changed, when an engine restarts
                judged = verdicts[name] = (card, quality_verdict(report, quality, task, name, card))
            if judged[1] is None:
                passed.append(mode)
            else:
                filtered[name] = judged[1]
        return passed


def quality_verdict(report: Mapping | None, quality: QualityPolicy, task: str, mode: str,
                    card: Mapping | None) -> Verdict | None:
    """The quality gate's verdict on ``mode`` for a request of ``task`` where it serves on the kernels ``card``
    describes (None: it passes): what the gate asks of every request, and what a staged start asks of the mode it
    would lead with, on the kernels its engine was measured with."""
    if report is None:
        return _NO_REPORT if quality.require_gate else None
    judged = judge_mode(report, quality, task, mode, card)
    if judged is None:
        return _NOT_IN_REPORT if quality.require_gate else None
    if judged.status == "pending":
        return Verdict(Code.QUALITY, f"{judged.detail} (require_gate)") if quality.require_gate \
            else Verdict(Code.GATE_PENDING, judged.detail)
    return None if judged.status == "pass" else Verdict(Code.QUALITY, judged.detail)


class MemoryGate(_EachMode):
    """Under memory pressure (free fraction below the policy's ``memory.min_headroom``), only modes whose
    KV is reserved at start take new requests: the others would allocate the request's KV now."""

    name = "memory"

    def __init__(self, kv_bytes_per_token: int) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        if cycle.features.memory_headroom >= cycle.policy.memory.min_headroom:  # no pressure: nothing to ask
            return modes
        return _EachMode.admit(self, modes, cycle, filtered)

    def check(self, mode: ModeView, cycle: Cycle) -> Verdict | None:
        floor, f = cycle.policy.memory.min_headroom, cycle.features
        if mode.preallocated_kv:
            return None
        need = self.kv_bytes_per_token * (f.prompt_tokens + f.max_tokens)
        return Verdict(Code.MEMORY, f"memory pressure: {f.memory_headroom:.1%} free < {floor:.1%}, and this mode "
                                    f"would allocate ~{need / 2**20:.1f} MiB of KV for the request")


class EnergyGate(_EachMode):
    """The mode's running J per generated token (measured or estimated, see ``modeswitch.energy``) is within
    the tightest cap the policy sets for it on this request. A mode that has not finished a request yet has
    no figure and passes: it cannot be judged before it has been tried."""

    name = "energy"

    def admit(self, modes: list[ModeView], cycle: Cycle, filtered: dict[str, Verdict]) -> list[ModeView]:
        if not cycle.policy.caps_energy:  # most policies cap nothing: nothing to ask
            return modes
        return _EachMode.admit(self, modes, cycle, filtered)

    def check(self, mode: ModeView, cycle: Cycle) -> Verdict | None:
        j = mode.j_per_token
        if j is None:
            return None
        cap = cycle.policy.energy_cap(mode.name, cycle.features)
        if cap is not None and j > cap[0]:
            return Verdict(Code.ENERGY, f"energy: {j:.4g} J/token over the cap of {cap[0]:g} ({cap[1]})")
        return None


def gates(kv_bytes_per_token: int) -> tuple[Gate, ...]:
    """Every gate, in the order they are asked (the first verdict is the one a mode is filtered with)."""
    return (AvailableGate(), QuarantineGate(), QualityGate(), CapabilityGate(), CapacityGate(),
            MemoryGate(kv_bytes_per_token), EnergyGate())
