"""The quality verdict: is a mode's eval result within tolerance of fp16's?

One function judges, for everything that shows or enforces a verdict: the gate report (its per-task
``pass`` and its markdown), the router's quality gate and ``/v1/modes``. Two copies of this judgement
disagreed before: they read their tolerances from different places, and a metric that came out NaN
failed in the report but passed the router. Pure Python, so the server imports it without lm-eval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class QualityPolicy:
    """How a gate report is read: tolerances, whether modes without one are refused, and which tasks make
    up each task family a request may name (``general``, and unknown families: all)."""

    max_drop_pp: float = 1.0
    max_ppl_increase_pct: float = 10.0
    require_gate: bool = False
    families: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def tasks_for(self, family: str, available: Iterable[str]) -> tuple[str, ...]:
        return dict(self.families).get(family) or tuple(available)

    def tolerance(self) -> dict[str, float]:
        """The tolerances as a report records them."""
        return {"max_drop_pp": self.max_drop_pp, "max_ppl_increase_pct": self.max_ppl_increase_pct}


def change(value: float, ref: float, higher_is_better: bool) -> float:
    """The change vs the reference: percentage points for accuracy-like metrics (higher is better, in
    [0, 1]), percent for perplexity-like ones (lower is better)."""
    return (value - ref) * 100 if higher_is_better else (value / ref - 1) * 100


def task_failure(task: str, value: float, ref: float, higher_is_better: bool, quality: QualityPolicy) -> str | None:
    """None if ``value`` is within tolerance of ``ref``, else what fails (e.g. ``ppl +40.0 %``).
    The comparisons are written so that a value that is not a number fails. The change is rounded to 1e-9 first:
    one document of 100 is 0.96 - 0.97 = -1.0000000000000009 pp in floating point, which is the 1.0 pp a
    tolerance of 1.0 allows."""
    delta = round(change(value, ref, higher_is_better), 9)
    if higher_is_better:
        return None if -delta <= quality.max_drop_pp else f"{task} {delta:+.1f} pp"
    return None if delta <= quality.max_ppl_increase_pct else f"{task} {delta:+.1f} %"


def judge(report: dict | None, quality: QualityPolicy, family: str) -> dict[str, str | None]:
    """Per mode in the report: None if it passes for ``family``, else why it fails."""
    if report is None:
        return {}
    base = report["modes"].get("fp16", {})
    tasks = [t for t in quality.tasks_for(family, report["tasks"]) if t in report["tasks"]]
    verdicts: dict[str, str | None] = {}
    for mode, per_task in report["modes"].items():
        failures = []
        for task in tasks:
            if task in per_task and task in base:
                why = task_failure(task, per_task[task]["value"], base[task]["value"],
                                   report["tasks"][task]["higher_is_better"], quality)
                if why is not None:
                    failures.append(why)
        verdicts[mode] = f"fails the quality gate ({', '.join(failures)})" if failures else None
    return verdicts
