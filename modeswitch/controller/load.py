"""Policy files: parse and validate one into a rule or learned policy.

The only module that knows both policy types, so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..yamlconf import Section, load_yaml
from .learned import parse_learned
from .policy import Policy, parse_common
from .rules import parse_rules

#: ``type:`` of a policy file -> its parser
PARSERS = {"rules": parse_rules, "learned": parse_learned}


def parse_policy(data: Any, source: str, known_modes: Iterable[str]) -> Policy:
    """A rule policy (``type: rules``, the default) or a learned one (``type: learned``)."""
    known = set(known_modes)
    sec = Section(data, source)
    kind = sec.get("type", str, "rules", tuple(PARSERS))
    return PARSERS[kind](sec, known, parse_common(sec, source, known))


def load_policy(path: str | Path, known_modes: Iterable[str]) -> Policy:
    """Parse and validate a policy file; raises :class:`ConfigError` naming file, line and field."""
    return parse_policy(load_yaml(path), str(path), known_modes)
