"""What the controller tests share: the shipped mode names, request features with defaults, policies parsed from
inline YAML, and a run of the shipped gate report."""

from __future__ import annotations

import json

from modeswitch.controller.features import Features
from modeswitch.controller.load import parse_policy
from modeswitch.controller.quality import runs
from modeswitch.weight_kinds import REFERENCE_MODE
from modeswitch.modes import load_modes
from modeswitch.resources import shipped_report
from modeswitch.yamlconf import load_yaml

MODES = [m.name for m in load_modes()]


def feats(**kw) -> Features:
    base = dict(prompt_tokens=100, max_tokens=32, prefix_match_tokens=0, prefix_match_ratio=0.0, queue_depth=0,
                memory_headroom=0.9, memory_free_gb=20.0, greedy=1)
    return Features(**{**base, **kw})


def policy_from(text: str, name: str = "p.yaml"):
    return parse_policy(load_yaml(name, text), name, MODES)


def shipped_run(engine: str = "vllm", compute: str = "bfloat16") -> dict:
    """The run of the shipped gate report for the demo on ``engine`` whose reference computed in ``compute`` and that
    scored the most modes (a machine with AMX scored only the modes it had no run for): for deciding over modes
    without engines (no kernels card), which the gate judges by whatever run it is given."""
    report = json.loads(shipped_report("demo", engine).read_text())
    return max((r for r in runs(report) if r["kernels"][REFERENCE_MODE]["compute"] == compute),
               key=lambda r: len(r["modes"]))
