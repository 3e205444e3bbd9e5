"""Rule policies from YAML: ordered rules over request features, first match wins.

```yaml
name: paper
rules:
  - name: shared-prefix
    when: {prefix_match_tokens: {ge: 256}}
    use: [gptq+prefix_cache, prefix_cache]   # first one that passes the gates
    prefer: prefix_match                     # optional: try modes holding a longer prefix of the prompt first
    energy: {max_j_per_token: 0.5}           # optional: for requests this rule matches, skip modes above this
default: [fp16]                              # when no rule matches
fallback: [fp16]                             # tried after a rule's (or the default's) own list
quality: {max_drop_pp: 1.0}                  # the quality gate's tolerances (see QualityPolicy)
energy: {max_j_per_token: 2.0, modes: {int8: 1.0}}   # energy gate: caps on each mode's running J/token
memory: {min_headroom: 0.05}                 # memory gate: below this free fraction, only preallocated-KV modes
```

Conditions are compiled to ``(feature, operator, value)`` triples at load, so matching a request is a
few attribute reads and comparisons.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..yamlconf import Section
from .completed import Completed
from .features import FEATURE_DOCS, Features
from .policy import COMMON_KEYS, Choice, EnergyPolicy, MemoryPolicy, positive
from .quality import QualityPolicy
from .verdicts import Verdict

OPERATORS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
             "ne": operator.ne}
SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


@dataclass(frozen=True)
class Condition:
    feature: str
    op: str
    value: float

    def holds(self, features: Features) -> bool:
        return OPERATORS[self.op](getattr(features, self.feature), self.value)

    def explain(self, features: Features) -> str:
        return f"{self.feature}={getattr(features, self.feature):g} {SYMBOLS[self.op]} {self.value:g}"


PREFER = ("prefix_match",)


@dataclass(frozen=True)
class Rule:
    name: str
    conditions: tuple[Condition, ...]
    use: tuple[str, ...]
    prefer: str | None = None
    max_j_per_token: float | None = None  # energy cap for the requests this rule matches

    def candidates(self, features: Features) -> tuple[str, ...]:
        """The rule's modes in the order to try them (stable: ties keep the file's order)."""
        if self.prefer == "prefix_match":
            held = features.prefix_match_by_mode
            return tuple(sorted(self.use, key=lambda m: -held.get(m, 0)))
        return self.use

    def matches(self, features: Features) -> bool:
        for c in self.conditions:
            if not c.holds(features):
                return False
        return True

    @property
    def energy_cap(self) -> tuple[float, str] | None:
        """The rule's own J/token cap and its label, for :meth:`EnergyPolicy.cap`."""
        return None if self.max_j_per_token is None else (self.max_j_per_token, f"rule {self.name!r}")


class _LastMatch:
    """The rule matched for the last features object seen. The energy gate asks for every mode with the
    same features object; walking the rules once per request, not once per mode, keeps decisions cheap.
    The pair is swapped whole, so concurrent requests never see one request's features with another's rule."""

    __slots__ = ("pair",)

    def __init__(self) -> None:
        self.pair: tuple[Features | None, Rule | None] = (None, None)


@dataclass(frozen=True)
class RulePolicy:
    name: str
    rules: tuple[Rule, ...]
    default: tuple[str, ...]
    fallback: tuple[str, ...]
    source: str = ""
    description: str = ""
    quality: QualityPolicy = QualityPolicy()
    energy: EnergyPolicy = EnergyPolicy()
    memory: MemoryPolicy = MemoryPolicy()
    _last_match: _LastMatch = field(default_factory=_LastMatch, init=False, repr=False, compare=False)

    def describe(self) -> dict[str, Any]:
        """The policy as ``GET /admin/policy`` shows it."""
        return {"name": self.name, "type": "rules", "source": self.source, "description": self.description,
                "rules": [{"name": r.name, "use": list(r.use), "when": [f"{c.feature} {c.op} {c.value:g}"
                                                                       for c in r.conditions]} for r in self.rules],
                "default": list(self.default), "fallback": list(self.fallback)}

    def match(self, features: Features) -> Rule | None:
        """The first rule whose conditions hold, or None (the default list applies)."""
        for r in self.rules:
            if r.matches(features):
                return r
        return None

    def choose(self, features: Features, filtered: Mapping[str, Verdict]) -> Choice:
        """The first mode of the matching rule's list (then the fallback list) that no gate filtered."""
        rule = self.match(features)
        if rule is not None:
            why = f"rule {rule.name!r} ({', '.join(c.explain(features) for c in rule.conditions) or 'always'})"
            candidates = rule.candidates(features)
        else:
            why = "no rule matched: default"
            candidates = self.default
        skipped = []
        for name in _unique(candidates + self.fallback):
            blocked = filtered.get(name)
            if blocked is None:
                tail = f"; skipped {'; '.join(skipped)}" if skipped else ""
                via = " (fallback)" if name not in candidates else ""
                return Choice(name, f"{why} -> {name}{via}{tail}", rule.name if rule else None)
            skipped.append(f"{name}: {blocked}")
        return Choice(None, f"{why}; no eligible mode: {'; '.join(skipped)}", rule.name if rule else None)

    @property
    def first_modes(self) -> tuple[str, ...]:
        """A request no rule matches goes to the default list, then the fallback."""
        return tuple(_unique(self.default + self.fallback))

    def energy_cap(self, mode: str, features: Features) -> tuple[float, str] | None:
        """The policy's caps on ``mode``, and the matching rule's for this request."""
        last_features, rule = self._last_match.pair
        if last_features is not features:
            rule = self.match(features)
            self._last_match.pair = (features, rule)
        return self.energy.cap(mode, rule.energy_cap if rule is not None else None)

    def observe(self, completed: Completed) -> None:
        """Rules do not learn."""

    def save(self) -> None:
        """Nothing learned, nothing to save."""

    def bind(self, batches: Mapping[str, str], batching: frozenset[str] = frozenset(),
             drafting: frozenset[str] = frozenset()) -> None:
        """A rule table names its modes itself: which share a batch changes nothing."""


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _mode_list(sec: Section, key: str, known: set[str], default=None) -> tuple[str, ...]:
    value = sec.get(key, (str, list), default) if default is not None else sec.get(key, (str, list))
    names = [value] if isinstance(value, str) else value
    if not names and key != "fallback":
        raise sec.error("must name at least one mode", key)
    for name in names:
        if not isinstance(name, str):
            raise sec.error(f"mode names must be strings, got {name!r}", key)
        if name not in known:
            raise sec.error(f"unknown mode {name!r} (modes: {', '.join(sorted(known))})", key)
    return tuple(names)


def parse_rules(sec: Section, known: set[str], common: dict[str, Any]) -> RulePolicy:
    """A ``type: rules`` policy; ``common``: the blocks every policy has (see ``policy.parse_common``)."""
    source = sec.source
    sec.only(COMMON_KEYS | {"rules", "default", "fallback"})
    rules = []
    raw_rules = sec.get("rules", list, [])
    for i, raw in enumerate(raw_rules):
        rsec = Section(raw, source, f"rules[{i}]")
        rsec.only({"name", "when", "use", "prefer", "energy"})
        name = rsec.get("name", str, f"rule{i + 1}")
        conditions = []
        when = rsec.section("when", Section({}, source, f"rules[{i}].when"))
        for feature in when.data:
            if feature not in FEATURE_DOCS:
                raise when.error(f"unknown feature (features: {', '.join(FEATURE_DOCS)})", str(feature))
            csec = when.section(str(feature))
            csec.only(OPERATORS)
            if not csec.data:
                raise when.error("needs an operator such as {ge: 256}", str(feature))
            for op in csec.data:
                conditions.append(Condition(str(feature), str(op), float(csec.get(str(op), (int, float)))))
        energy = rsec.section("energy", None)
        cap = None
        if energy is not None:
            energy.only({"max_j_per_token"})
            cap = positive(energy, "max_j_per_token", None)
        rules.append(Rule(name, tuple(conditions), _mode_list(rsec, "use", known),
                          rsec.get("prefer", str, None, PREFER), cap))
    return RulePolicy(
        rules=tuple(rules),
        default=_mode_list(sec, "default", known),
        fallback=_mode_list(sec, "fallback", known, []),
        **common,
    )
