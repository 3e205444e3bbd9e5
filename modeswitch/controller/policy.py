"""What every policy is: the :class:`Policy` protocol, its result (:class:`Choice`) and the blocks all
policy files share (quality, energy, memory), parsed here once.

Rule and learned policies both import this module and nothing of each other; the controller and the
gates talk to either through the protocol alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from ..yamlconf import Section
from .completed import Completed
from .features import Features
from .quality import QualityPolicy
from .verdicts import Verdict


class Choice:
    """A policy's pick: the mode (None: none eligible), the rule that picked it, why, and what the policy expected
    of it. The why and the expectation may be given as functions that write them: they are read when the
    response's ``modeswitch`` block is written, after the request went to its engine, so a decision does not
    spend its time on text no one has asked for yet (written once, on the first read)."""

    __slots__ = ("mode", "rule", "_reason", "_prediction")

    def __init__(self, mode: str | None, reason: str | Callable[[], str], rule: str | None,
                 prediction: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.mode, self.rule, self._reason, self._prediction = mode, rule, reason, prediction

    @property
    def reason(self) -> str:
        if callable(self._reason):
            self._reason = self._reason()
        return self._reason

    @property
    def prediction(self) -> Mapping[str, Any] | None:
        if callable(self._prediction):
            self._prediction = self._prediction()
        return self._prediction

    def __repr__(self) -> str:
        return f"Choice({self.mode!r}, {self.reason!r}, {self.rule!r}, {self.prediction!r})"


@dataclass(frozen=True)
class EnergyPolicy:
    """Caps on a mode's running J per generated token: one for every mode, and tighter or looser ones per
    mode; a policy may add its own for a request (a rule policy: the matching rule's). The tightest wins."""

    max_j_per_token: float | None = None
    modes: tuple[tuple[str, float], ...] = ()

    def cap(self, mode: str, extra: tuple[float, str] | None = None) -> tuple[float, str] | None:
        """The tightest cap for ``mode`` (with ``extra``, a request's own cap) and where it comes from, or
        None when uncapped."""
        caps = []
        per_mode = next((cap for name, cap in self.modes if name == mode), None)
        if per_mode is not None:
            caps.append((per_mode, f"energy.modes.{mode}"))
        elif self.max_j_per_token is not None:
            caps.append((self.max_j_per_token, "energy.max_j_per_token"))
        if extra is not None:
            caps.append(extra)
        return min(caps) if caps else None

    @property
    def capped(self) -> bool:
        """Whether it caps any mode at all."""
        return self.max_j_per_token is not None or bool(self.modes)


@dataclass(frozen=True)
class MemoryPolicy:
    """Below ``min_headroom`` (free fraction of device memory) a request may only go to modes whose KV is
    reserved at start (continuous batching's block pool, static caches): they allocate nothing new."""

    min_headroom: float = 0.05


class Policy(Protocol):
    """Scores and picks a mode among those the gates let through, and says what the gates need of it."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str:
        """The file it was loaded from (what a reload re-reads)."""

    @property
    def quality(self) -> QualityPolicy: ...

    @property
    def first_modes(self) -> tuple[str, ...]:
        """The modes a plain request goes to, in order of preference (what a staged start loads first)."""

    @property
    def orders_by_measurement(self) -> bool:
        """Whether a plain request goes to the mode its engine's measured costs predict to finish first, the list
        ordering only what is not measured: then a staged start leads with the weights measured fastest here."""

    @property
    def tested_features(self) -> frozenset[str]:
        """The features (``FEATURE_DOCS`` names) its rules test. ``speculation_gain`` costs a prediction of every
        drafting pair: the service computes it only for a policy that tests it."""

    @property
    def energy(self) -> EnergyPolicy: ...

    @property
    def memory(self) -> MemoryPolicy: ...

    def choose(self, features: Features, filtered: Mapping[str, Verdict],
               predict: Callable[[str], Any] | None = None,
               energy: Callable[[str], float | None] | None = None) -> Choice:
        """A mode not in ``filtered`` (or none, with the reason). ``predict``: a mode's predicted time for this
        request from the measured costs (``CostModel.predict``; None where not measured), for a policy that
        orders by it; ``energy``: a mode's running watts (None before its first request), for a policy that orders
        by energy (its predicted time at them)."""

    def describe(self) -> dict[str, Any]:
        """The policy as ``GET /admin/policy`` shows it."""

    def energy_cap(self, mode: str, features: Features) -> tuple[float, str] | None:
        """The tightest J/token cap on ``mode`` for this request and where it comes from (the energy gate)."""

    @property
    def caps_energy(self) -> bool:
        """Whether it caps any mode's energy on any request (the energy gate asks nothing otherwise)."""

    def observe(self, completed: Completed) -> None:
        """A request finished (a learning policy picks what it learns from)."""

    def save(self) -> None:
        """Persist what the policy has learned (before a reload, at shutdown)."""

    def bind(self, batches: Mapping[str, str], batching: frozenset[str] = frozenset(),
             drafting: frozenset[str] = frozenset()) -> None:
        """Which resident modes share one running batch (mode -> its engine's name): modes that differ only
        in per-request options there cost the same, which a learning policy need not learn twice.
        ``batching``: the modes whose engine runs requests together (the rest serve one at a time);
        ``drafting``: the modes that decode speculatively."""


def parse_common(sec: Section, source: str, known: set[str]) -> dict[str, Any]:
    """The fields every policy file has, as keyword arguments of either policy's constructor."""
    return dict(
        name=sec.get("name", str, Path(source).stem),
        description=sec.get("description", str, ""),
        source=source,
        quality=_quality(sec.section("quality", None)),
        energy=_energy(sec.section("energy", None), known),
        memory=_memory(sec.section("memory", None)),
    )


#: The top-level keys :func:`parse_common` reads (each policy type adds its own).
COMMON_KEYS = frozenset({"name", "type", "description", "quality", "energy", "memory"})


def positive(sec: Section, key: str, default: float | None) -> float | None:
    value = sec.get(key, (int, float), default)
    if value is not None and value <= 0:
        raise sec.error(f"must be positive, got {value}", key)
    return None if value is None else float(value)


def _energy(sec: Section | None, known: set[str]) -> EnergyPolicy:
    if sec is None:
        return EnergyPolicy()
    sec.only({"max_j_per_token", "modes"})
    modes = sec.section("modes", Section({}, sec.source, "energy.modes"))
    caps = []
    for mode in modes.data:
        if mode not in known:
            raise modes.error(f"unknown mode (modes: {', '.join(sorted(known))})", str(mode))
        caps.append((str(mode), positive(modes, str(mode), None)))
    return EnergyPolicy(max_j_per_token=positive(sec, "max_j_per_token", None), modes=tuple(caps))


def _memory(sec: Section | None) -> MemoryPolicy:
    if sec is None:
        return MemoryPolicy()
    sec.only({"min_headroom"})
    value = float(sec.get("min_headroom", (int, float), MemoryPolicy.min_headroom))
    if not 0 <= value < 1:
        raise sec.error(f"must be a fraction in [0, 1), got {value}", "min_headroom")
    return MemoryPolicy(min_headroom=value)


def _quality(sec: Section | None) -> QualityPolicy:
    if sec is None:
        return QualityPolicy()
    sec.only({"max_drop_pp", "max_ppl_increase_pct", "require_gate", "families"})
    families = sec.section("families", Section({}, sec.source, "quality.families"))
    parsed = []
    for family, tasks in families.data.items():
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
            raise families.error("must be a non-empty list of task names", str(family))
        parsed.append((str(family), tuple(tasks)))
    return QualityPolicy(
        max_drop_pp=float(sec.get("max_drop_pp", (int, float), QualityPolicy.max_drop_pp)),
        max_ppl_increase_pct=float(sec.get("max_ppl_increase_pct", (int, float), QualityPolicy.max_ppl_increase_pct)),
        require_gate=sec.get("require_gate", bool, QualityPolicy.require_gate),
        families=tuple(parsed),
    )
