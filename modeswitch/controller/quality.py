"""The quality verdict: is a mode's eval result within tolerance of fp16's?

One function judges, for everything that shows or enforces a verdict: the gate report (its per-task
``pass`` and its markdown), the router's quality gate and ``/v1/modes``. Two copies of this judgement
disagreed before: they read their tolerances from different places, and a metric that came out NaN
failed in the report but passed the router. A report may hold runs scored on several machines' kernels; a mode is
judged by the row scored on the kernels it serves on (:func:`judge_mode`), and is pending where there is none. Pure
Python, so the server imports it without lm-eval.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from ..weight_kinds import REFERENCE_MODE
from ..yamlconf import ConfigError

log = logging.getLogger(__name__)


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
    base = report["modes"].get(REFERENCE_MODE, {})
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


#: the fields of a kernels card (``/v1/modes`` ``kernels``) that decide what a row's scores hold for. The engine's
#: name is not one: the same kernels score the same in whichever engine a layout puts them.
KERNEL_FIELDS = ("weights", "weight_format", "activations", "compute", "kernel")


def runs(report: Mapping) -> list[Mapping]:
    """The gate runs a report holds, oldest first: each scored every mode on one machine's kernels against a
    reference on the same kernels. The gate writes them under ``runs``; a report of a single run (its ``modes`` at
    the top) is that one run."""
    return list(report["runs"]) if "runs" in report else [report]


def read_report(path: Path, cache: Path | None = None) -> dict:
    """The gate report at ``path``, checked (every run has the reference's results), with the runs of its
    namesake in ``cache`` (a directory of runs this machine scored itself, ``modeswitch.evals.behind``) after its
    own: the newest. A broken report raises ConfigError; a broken cached one is left out."""
    report = _checked(path)
    cached = cache / path.name if cache is not None else None
    if cached is not None and cached.is_file():
        try:
            report = {**report, "runs": [*runs(report), *runs(_checked(cached))]}
        except ConfigError as exc:
            log.warning("quality gate: the runs scored here are left out: %s", exc)
    return report


def _checked(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
        if not runs(report) or any(not isinstance(r.get("modes"), dict) or REFERENCE_MODE not in r["modes"]
                                   for r in runs(report)):
            raise ValueError(f"a run has no {REFERENCE_MODE} reference results")
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{path}: not a quality gate report: {exc}") from None
    return report


def kernels_key(card: Mapping | None) -> tuple | None:
    """What a row's kernels must equal for its scores to hold for a mode (None: the card is not known)."""
    return None if card is None else tuple(card.get(f) for f in KERNEL_FIELDS)


def describe_kernels(card: Mapping | None) -> str:
    """A kernels card in one phrase: weights x activations (compute dtype), kernel."""
    if not card:
        return "–"
    return f"{card['weights']} x {card['activations']} ({card['compute']}), {card['kernel']}"


@dataclass(frozen=True)
class Judged:
    """A mode's quality verdict as the server stands: ``pass``, ``fail`` or ``pending`` (its rows were scored on
    other kernels than the ones it serves on here, so no verdict holds for it yet), why (empty on a pass), the run
    whose row it is judged by (None while pending) and the kernels card of the row shown (when pending: the newest
    row's, on other kernels)."""

    status: str
    detail: str
    run: Mapping | None
    scored_on: Mapping | None


def judge_mode(report: Mapping, quality: QualityPolicy, family: str, mode: str,
               card: Mapping | None) -> Judged | None:
    """``mode``'s verdict for ``family`` when it serves on the kernels ``card`` describes; None when no run has a
    row for it. The row that counts is the newest whose kernels equal ``card`` (:data:`KERNEL_FIELDS`). Where
    every row was scored on other kernels the mode is pending, except the reference, which passes on any kernels.
    A mode whose engine does not describe its kernels (``card`` None) is judged by the newest row, as
    :func:`~modeswitch.weights.precision.mismatch` takes such an engine at its word."""
    holding = [r for r in runs(report) if mode in r["modes"]]
    if not holding:
        return None
    newest = holding[-1]
    if card is not None:
        key = kernels_key(card)
        same = [r for r in holding if kernels_key(r.get("kernels", {}).get(mode)) == key]
        if not same:
            row = newest.get("kernels", {}).get(mode)
            if mode == REFERENCE_MODE:
                return Judged("pass", "", None, row)
            return Judged("pending", f"gate pending: its rows were scored on other kernels ({_differences(row, card)})",
                          None, row)
        newest = same[-1]
    why = judge(newest, quality, family).get(mode)
    return Judged("pass" if why is None else "fail", why or "", newest, newest.get("kernels", {}).get(mode))


def _differences(row: Mapping | None, card: Mapping) -> str:
    """How a row's kernels differ from the ones a mode serves on, e.g. ``compute bfloat16 there, float32 here``."""
    if row is None:
        return "the row does not record them"
    return "; ".join(f"{f} {row.get(f)} there, {card.get(f)} here" for f in KERNEL_FIELDS if row.get(f) != card.get(f))
