"""Rule policies from YAML: ordered rules over request features, first match wins.

```yaml
name: paper
rules:
  - name: shared-prefix
    when: {prefix_match_tokens: {ge: 256}}
    use: [gptq+prefix_cache, prefix_cache]   # first one that passes the gates
    prefer: prefix_match                     # optional: try modes holding a longer prefix of the prompt first
default: [fp16]                              # when no rule matches
fallback: [fp16]                             # tried after a rule's (or the default's) own list
```

Conditions are compiled to ``(feature, operator, value)`` triples at load, so matching a request is a
few attribute reads and comparisons.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from ..yamlconf import ConfigError, Section, load_yaml
from .features import FEATURE_DOCS, Features

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


@dataclass(frozen=True)
class QualityPolicy:
    """How the quality gate reads a gate report: tolerances, whether modes without one are refused, and
    which tasks make up each task family a request may name (``general``, and unknown families: all)."""

    max_drop_pp: float = 1.0
    max_ppl_increase_pct: float = 10.0
    require_gate: bool = False
    families: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def tasks_for(self, family: str, available: Iterable[str]) -> tuple[str, ...]:
        return dict(self.families).get(family) or tuple(available)


@dataclass(frozen=True)
class RulePolicy:
    name: str
    rules: tuple[Rule, ...]
    default: tuple[str, ...]
    fallback: tuple[str, ...]
    source: str = ""
    description: str = ""
    quality: QualityPolicy = QualityPolicy()

    def choose(self, features: Features, filtered: Mapping[str, str]) -> Choice:
        """The first mode of the matching rule's list (then the fallback list) that no gate filtered."""
        rule = None
        for r in self.rules:
            if r.matches(features):
                rule = r
                break
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


def parse_policy(data, source: str, known_modes: Iterable[str]) -> RulePolicy:
    known = set(known_modes)
    sec = Section(data, source)
    sec.only({"name", "type", "description", "rules", "default", "fallback", "quality"})
    sec.get("type", str, "rules", ("rules",))
    rules = []
    raw_rules = sec.get("rules", list, [])
    for i, raw in enumerate(raw_rules):
        rsec = Section(raw, source, f"rules[{i}]")
        rsec.only({"name", "when", "use", "prefer"})
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
        rules.append(Rule(name, tuple(conditions), _mode_list(rsec, "use", known),
                          rsec.get("prefer", str, None, PREFER)))
    return RulePolicy(
        name=sec.get("name", str, Path(source).stem),
        description=sec.get("description", str, ""),
        rules=tuple(rules),
        default=_mode_list(sec, "default", known),
        fallback=_mode_list(sec, "fallback", known, []),
        source=source,
        quality=_quality(sec.section("quality", None)),
    )


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
        max_drop_pp=float(sec.get("max_drop_pp", (int, float), 1.0)),
        max_ppl_increase_pct=float(sec.get("max_ppl_increase_pct", (int, float), 10.0)),
        require_gate=sec.get("require_gate", bool, False),
        families=tuple(parsed),
    )


def load_policy(path: str | Path, known_modes: Iterable[str]) -> RulePolicy:
    """Parse and validate a policy file; raises :class:`ConfigError` naming file, line and field."""
    return parse_policy(load_yaml(path), str(path), known_modes)


__all__ = ["ConfigError", "RulePolicy", "Rule", "Condition", "Choice", "load_policy", "parse_policy"]
