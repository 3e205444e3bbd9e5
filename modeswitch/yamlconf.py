"""YAML loading with errors that name the file, the line and the field.

Modes and policies are data edited by hand; a typo must be reported where it is, and must never be
half-applied. :func:`load_yaml` keeps the line of every mapping key, and :class:`Section` reads typed
fields from a mapping, rejecting unknown keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml


class ConfigError(ValueError):
    """A mode or policy file is invalid; the message says where and why."""


class ConfigMap(dict):
    """A dict that remembers the line of the mapping and of each key."""

    line: int = 0
    key_lines: dict[str, int]


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> ConfigMap:
    data = ConfigMap(loader.construct_mapping(node, deep=True))
    data.line = node.start_mark.line + 1
    data.key_lines = {str(key.value): key.start_mark.line + 1 for key, _ in node.value}
    return data


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)

_MISSING = object()


def load_yaml(source: str | Path, text: str | None = None) -> Any:
    """Parse a YAML file (or ``text`` labelled with ``source``); syntax errors carry the line."""
    if text is None:
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from exc
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}{where}: invalid YAML: {problem}") from exc


class Section:
    """Typed reads from one mapping of a config file; every error names file:line and the field path."""

    def __init__(self, data: Any, source: str | Path, path: str = "") -> None:
        self.source = str(source)
        self.path = path
        if not isinstance(data, dict):
            raise ConfigError(f"{self.source}: {path + ': ' if path else ''}expected a mapping, got {type(data).__name__}")
        self.data = data

    def error(self, message: str, key: str | None = None) -> ConfigError:
        """A ConfigError at ``key``'s line (or the mapping's) naming the full field path."""
        line = getattr(self.data, "key_lines", {}).get(key) or getattr(self.data, "line", 0)
        field = ".".join(p for p in (self.path, key) if p)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {field + ': ' if field else ''}{message}")

    def get(self, key: str, types: type | tuple[type, ...], default: Any = _MISSING, choices: Iterable | None = None) -> Any:
        if key not in self.data:
            if default is _MISSING:
                raise self.error("is required", key)
            return default
        value = self.data[key]
        if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.error(f"expected {_names(types)}, got a boolean", key)
        if not isinstance(value, types):
            raise self.error(f"expected {_names(types)}, got {type(value).__name__} {value!r}", key)
        if choices is not None and value not in choices:
            raise self.error(f"must be one of {', '.join(map(str, choices))}; got {value!r}", key)
        return value

    def section(self, key: str, default: Any = _MISSING) -> "Section | None":
        if key not in self.data and default is not _MISSING:
            return default
        return Section(self.get(key, dict), self.source, ".".join(p for p in (self.path, key) if p))

    def only(self, allowed: Iterable[str]) -> None:
        allowed = set(allowed)
        for key in self.data:
            if key not in allowed:
                raise self.error(f"unknown field (allowed: {', '.join(sorted(allowed))})", str(key))


def _names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    if set(types) == {int, float}:
        return "a number"
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
                        "list": "a list", "dict": "a mapping"}.get(t.__name__, t.__name__) for t in types)
