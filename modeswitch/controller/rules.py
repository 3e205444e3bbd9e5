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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..yamlconf import ConfigError, Section, load_yaml
from .features import FEATURE_DOCS, Features
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


@dataclass(frozen=True)
class Choice:
    mode: str | None
    reason: str
    rule: str | None
    prediction: Mapping[str, Any] | None = None  # what a learned policy expected of the mode it chose


@dataclass(frozen=True)
class EnergyPolicy:
    """Caps on a mode's running J per generated token: one for every mode, and tighter or looser ones per
    mode; a matching rule's own cap applies on top. The tightest cap that applies wins."""

    max_j_per_token: float | None = None
    modes: tuple[tuple[str, float], ...] = ()

    def cap(self, mode: str, rule: Rule | None) -> tuple[float, str] | None:
        """The tightest cap for ``mode`` under ``rule`` and where it comes from, or None when uncapped."""
        caps = []
        per_mode = dict(self.modes).get(mode)
        if per_mode is not None:
            caps.append((per_mode, f"energy.modes.{mode}"))
        elif self.max_j_per_token is not None:
            caps.append((self.max_j_per_token, "energy.max_j_per_token"))
        if rule is not None and rule.max_j_per_token is not None:
            caps.append((rule.max_j_per_token, f"rule {rule.name!r}"))
        return min(caps) if caps else None


@dataclass(frozen=True)
class MemoryPolicy:
    """Below ``min_headroom`` (free fraction of device memory) a request may only go to modes whose KV is
    reserved at start (continuous batching's block pool, static caches): they allocate nothing new."""

    min_headroom: float = 0.05


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


def parse_policy(data, source: str, known_modes: Iterable[str]):
    """A :class:`RulePolicy` (``type: rules``, the default) or a learned one (``type: learned``)."""
    known = set(known_modes)
    sec = Section(data, source)
    kind = sec.get("type", str, "rules", ("rules", "learned"))
    common = dict(
        name=sec.get("name", str, Path(source).stem),
        description=sec.get("description", str, ""),
        quality=_quality(sec.section("quality", None)),
        energy=_energy(sec.section("energy", None), known),
        memory=_memory(sec.section("memory", None)),
    )
    if kind == "learned":
        from .learned import parse_learned

        return parse_learned(sec, source, known, common)
    sec.only({"name", "type", "description", "rules", "default", "fallback", "quality", "energy", "memory"})
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
            cap = _positive(energy, "max_j_per_token", None)
        rules.append(Rule(name, tuple(conditions), _mode_list(rsec, "use", known),
                          rsec.get("prefer", str, None, PREFER), cap))
    return RulePolicy(
        rules=tuple(rules),
        default=_mode_list(sec, "default", known),
        fallback=_mode_list(sec, "fallback", known, []),
        source=source,
        **common,
    )


def _positive(sec: Section, key: str, default):
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
        caps.append((str(mode), _positive(modes, str(mode), None)))
    return EnergyPolicy(max_j_per_token=_positive(sec, "max_j_per_token", None), modes=tuple(caps))


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
        require_gate=sec.get("require_gate", bool, False),
        families=tuple(parsed),
    )


def load_policy(path: str | Path, known_modes: Iterable[str]):
    """Parse and validate a policy file; raises :class:`ConfigError` naming file, line and field."""
    return parse_policy(load_yaml(path), str(path), known_modes)


__all__ = ["ConfigError", "RulePolicy", "Rule", "Condition", "Choice", "load_policy", "parse_policy"]
