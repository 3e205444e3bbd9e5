"""What the controller tests share: the shipped mode names, request features with defaults, and policies
parsed from inline YAML."""

from __future__ import annotations

from modeswitch.controller.features import Features
from modeswitch.controller.load import parse_policy
from modeswitch.modes import load_modes
from modeswitch.yamlconf import load_yaml

MODES = [m.name for m in load_modes()]


def feats(**kw) -> Features:
    base = dict(prompt_tokens=100, max_tokens=32, prefix_match_tokens=0, prefix_match_ratio=0.0, queue_depth=0,
                memory_headroom=0.9, memory_free_gb=20.0, greedy=1)
    return Features(**{**base, **kw})


def policy_from(text: str, name: str = "p.yaml"):
    return parse_policy(load_yaml(name, text), name, MODES)
