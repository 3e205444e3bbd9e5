"""The quality gate: every mode scored with lm-eval, compared with fp16, written as a report the router enforces.

    python -m modeswitch.evals.gate --model demo [--backend auto|vllm|transformers] [--limit 200]
        [--tasks jargon_cloze,jargon_ppl,jargon_copy] [--policy policies/NAME.yaml] [--dtype float32]
    python -m modeswitch.evals.gate --merge REPORT [--out DIR]

Every mode is scored on the engine family that serves it (``--backend``, resolved as ``serve.py`` resolves it):
a quantization is judged as that engine runs it (vLLM's int8 weight-only kernels are not bitsandbytes'
LLM.int8), so a report is written per model and engine and the server enforces the one for its engine.
Scoring tasks (multiple_choice, loglikelihood, loglikelihood_rolling) depend only on a mode's weights, so
they run once per weights variant and every mode on those weights shares the result; generate_until
tasks run on every mode, through its own engine. Deltas vs fp16: accuracy-like metrics (higher is
better, in [0, 1]) in percentage points; perplexity-like metrics (lower is better) as a relative change
in percent. Pass/fail is judged by ``controller.quality`` (what the router and ``/v1/modes`` use too) with
the tolerances of a policy's ``quality`` block (``--policy``; without one, the defaults of
:class:`QualityPolicy`). The reference is the server's (``--dtype``, default: the device's native 16-bit type),
and the run records per mode the kernels its row was scored on (its ``/v1/modes`` card, ``kernels``) and the machine.
A report holds one run per set of kernels (``runs``): a new run replaces the one scored on the same kernels and
keeps the others, so one file serves every machine class, each judged by the rows scored on its own kernels.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..config import BACKENDS, DTYPES, LoadConfig, ServerConfig
from ..controller.load import load_policy
from ..controller.quality import (QualityPolicy, change, describe_kernels, judge, kernels_key, runs,
                                  task_failure)
from ..device import cap_kernels, machine
from ..files import replace_whole
from ..modes import DEFAULT_MODES_DIR, load_modes
from ..resources import REPORTS_DIR, shipped_report
from ..weight_kinds import REFERENCE_MODE
from .intervals import CONFIDENCE, documents_needed, paired_interval, per_document, uncertain
from .run import TASKS, evaluate, task_manager

SCORING = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


def task_kinds(tasks) -> dict[str, dict]:
    """Per task: output type, primary metric key (``metric,filter``) and whether higher is better."""
    from lm_eval.tasks import get_task_dict

    tdict = get_task_dict(list(tasks), task_manager(tasks))
    kinds = {}
    for name, task in tdict.items():
        cfg = task.config
        metric = cfg.metric_list[0]["metric"]
        filters = cfg.filter_list or []
        filter_name = filters[0]["name"] if filters else "none"
        kinds[name] = {"output_type": cfg.output_type, "metric": f"{metric},{filter_name}",
                       "higher_is_better": bool(task.higher_is_better().get(metric, True))}
    return kinds


def mark(report: dict) -> None:
    """Write each mode's delta vs fp16 and pass/fail into the report's entries, judged with the report's
    tolerances; where the report holds per-document scores (``documents``), each entry of a mode other than the
    reference also gets the paired bootstrap interval of its delta (``ci``), whether its verdict is ``uncertain``
    (see :func:`~.intervals.uncertain`) and the ``documents_needed`` for a half-width within the tolerance."""
    quality = QualityPolicy(**report["tolerance"])
    base = report["modes"][REFERENCE_MODE]
    documents = report.get("documents", {})
    for mode, per_task in report["modes"].items():
        for task, entry in per_task.items():
            higher, ref = report["tasks"][task]["higher_is_better"], base[task]["value"]
            entry["delta_pp" if higher else "delta_pct"] = round(change(entry["value"], ref, higher), 2)
            entry["pass"] = task_failure(task, entry["value"], ref, higher, quality) is None
            scores, ref_scores = documents.get(mode, {}).get(task), documents.get(REFERENCE_MODE, {}).get(task)
            if mode == REFERENCE_MODE or not scores or not ref_scores:
                continue
            interval = paired_interval(scores, ref_scores, higher)
            if interval is None:
                continue
            lo, hi, n = interval
            tolerance = quality.max_drop_pp if higher else quality.max_ppl_increase_pct
            entry["ci"] = [round(lo, 2), round(hi, 2)]
            entry["uncertain"] = uncertain(lo, hi, tolerance, higher)
            entry["documents_needed"] = documents_needed((hi - lo) / 2, n, tolerance)


def run_gate(model: str, modes_dirs, tasks=TASKS, limit: int | None = None, quality: QualityPolicy = QualityPolicy(),
             gptq: str | None = None, backend: str = "transformers", dtype: str = LoadConfig.dtype,
             progress=print) -> dict:
    """Every mode of ``modes_dirs`` scored on engines built for it alone, as ``serve.py`` would build them."""
    from .adapter import ModeSwitchLM

    return score_modes(model, load_modes(*modes_dirs),
                       lambda spec: ModeSwitchLM(model=model, spec=spec, gptq=gptq, backend=backend, dtype=dtype),
                       tasks, limit, quality, progress)


def score_modes(model: str, specs, open_lm, tasks=TASKS, limit: int | None = None,
                quality: QualityPolicy = QualityPolicy(), progress=print) -> dict:
    """A gate run over ``specs`` (the reference among them): ``open_lm(spec)`` gives the lm-eval model that scores
    a mode (a RuntimeError: the mode is unavailable, and listed so)."""
    kinds = task_kinds(tasks)
    scoring = [t for t, k in kinds.items() if k["output_type"] in SCORING]
    generating = [t for t in kinds if t not in scoring]
    started = time.perf_counter()
    by_weights: dict[str, dict] = {}
    modes: dict[str, dict] = {}
    #: mode -> task -> doc_id -> its score (what the verdicts' paired intervals resample)
    documents: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    kernels: dict[str, dict | None] = {}
    served_by = None
    for spec in specs:
        t0 = time.perf_counter()
        try:
            lm = open_lm(spec)
        except RuntimeError as exc:
            unavailable[spec.name] = str(exc)
            progress(f"gate: {spec.name}: unavailable ({exc})")
            continue
        served_by, kernels[spec.name] = lm.backend, lm.kernels
        try:
            if scoring and spec.weights not in by_weights:
                by_weights[spec.weights] = evaluate(lm, scoring, limit, log_samples=True)
            evaluated = [by_weights[spec.weights]] if scoring else []
            if generating:
                evaluated.append(evaluate(lm, generating, limit, log_samples=True))
        finally:
            lm.close()
        results = {t: r for e in evaluated for t, r in e["results"].items()}
        documents[spec.name] = {t: per_document(s, kinds[t]["metric"]) for e in evaluated
                                for t, s in e["samples"].items() if t in kinds}
        modes[spec.name] = {t: {"metric": kinds[t]["metric"], "value": float(results[t][kinds[t]["metric"]]),
                                "stderr": _num(results[t].get(kinds[t]["metric"].replace(",", "_stderr,", 1)))}
                            for t in kinds}
        progress(f"gate: {spec.name}: " + ", ".join(f"{t} {v['value']:.4g}" for t, v in modes[spec.name].items())
                 + f" ({time.perf_counter() - t0:.0f} s)")
    if REFERENCE_MODE not in modes:
        raise RuntimeError(f"the {REFERENCE_MODE} mode is the reference and must be available for the gate")
    import lm_eval
    import torch
    import transformers

    report = {"model": model, "backend": served_by, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "limit": limit,
              "machine": machine(), "tolerance": quality.tolerance(), "tasks": kinds, "modes": modes,
              "kernels": kernels, "unavailable": unavailable, "documents": documents,
              "seconds": round(time.perf_counter() - started, 1),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "lm_eval": lm_eval.__version__}}
    mark(report)
    return report


def _num(x):
    return float(x) if isinstance(x, (int, float)) else None


def render(report: dict) -> str:
    """A report as markdown, one section per run (oldest first). A mode's verdict in a run is what the router's
    quality gate and ``/v1/modes`` say for the ``general`` task family under the run's tolerances, on a machine
    whose kernels are the ones that run scored it on."""
    return "\n".join(render_run(run) for run in runs(report))


def render_run(report: dict) -> str:
    """One gate run as a markdown section."""
    tasks = list(report["tasks"])
    verdicts = judge(report, QualityPolicy(**report["tolerance"]), "general")
    backend = f" on {report['backend']}" if report.get("backend") else ""
    reference = describe_kernels(report.get("kernels", {}).get(REFERENCE_MODE))
    lines = [f"# Quality gate: {report['model']}{backend}, reference {reference} ({report['date']})", "",
             *([f"Scored on {report['machine']}.", ""] if report.get("machine") else []),
             f"Limit {report['limit'] or 'all'} documents per task; tolerance: accuracy drop <= "
             f"{report['tolerance']['max_drop_pp']} pp, perplexity increase <= "
             f"{report['tolerance']['max_ppl_increase_pct']} %. Took {report['seconds']:.0f} s. Deltas carry the "
             f"{CONFIDENCE:.0%} paired bootstrap interval over the documents both the mode and fp16 scored; a verdict "
             "is uncertain where the interval reaches both sides of the tolerance.", "",
             "| mode | " + " | ".join(f"{t} ({report['tasks'][t]['metric'].split(',')[0]})" for t in tasks)
             + " | gate | linears |", "|---|" + "---|" * (len(tasks) + 2)]
    for mode, per_task in report["modes"].items():
        cells = []
        for t in tasks:
            e = per_task[t]
            err = f" ± {e['stderr']:.3f}" if e["stderr"] is not None else ""
            unit = " pp" if "delta_pp" in e else " %"
            delta = f"{e.get('delta_pp', e.get('delta_pct')):+.1f}{unit}"
            if "ci" in e:
                delta += f", {CONFIDENCE:.0%} CI [{e['ci'][0]:+.1f}, {e['ci'][1]:+.1f}]" + \
                    (f", uncertain: needs ~{e['documents_needed']} documents" if e["uncertain"] else "")
            cells.append(f"{e['value']:.4g}{err} ({delta}{'' if e['pass'] else ', FAIL'})")
        verdict = "pass" if verdicts[mode] is None else "fail"
        if any(per_task[t].get("uncertain") for t in tasks):
            verdict += " (uncertain)"
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {verdict} | "
                     f"{describe_kernels(report.get('kernels', {}).get(mode))} |")
    for mode, why in report["unavailable"].items():
        lines.append(f"| {mode} | " + " | ".join("–" for _ in tasks) + f" | unavailable: {why} | – |")
    return "\n".join(lines) + "\n"


def run_kernels(run: dict) -> dict:
    """What a run was scored on: each mode's kernels (:func:`kernels_key`), the engines' names left out."""
    return {mode: kernels_key(card) for mode, card in run.get("kernels", {}).items()}


def merged(existing: dict | None, run: dict) -> dict:
    """The report ``existing`` with ``run`` added as its newest run. A run on the same kernels, mode for mode, is
    replaced (the same machine scored again); runs on other kernels are kept, since each holds on the machines
    that serve those kernels (a bf16 run on AVX-512 CPUs, a float32 run on AVX2 ones)."""
    kept = [r for r in runs(existing) if run_kernels(r) != run_kernels(run)] if existing else []
    return {"model": run["model"], "backend": run["backend"], "runs": [*kept, run]}


def write(run: dict, out_dir: Path = REPORTS_DIR) -> Path:
    """Add ``run`` to the report for its model and engine in ``out_dir``; returns its path."""
    return add_run(shipped_report(run["model"], run["backend"], out_dir), run)


def add_run(path: Path, run: dict) -> Path:
    """Add ``run`` to the report at ``path`` (see :func:`merged`) and write its markdown beside it. Each file is
    replaced whole: a server reading the report meanwhile (the replicas of a cluster share the cache a server keeps
    its own runs in) reads the old one or the new one, never half of one. Writers of one report take turns
    (:class:`~modeswitch.evals.behind.PendingScorer` holds the report's lock while it scores and adds its run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = merged(json.loads(path.read_text()) if path.is_file() else None, run)
    replace_whole(path, json.dumps(report, indent=2))
    replace_whole(path.with_suffix(".md"), render(report))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m modeswitch.evals.gate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=ServerConfig.model)
    ap.add_argument("--backend", default=LoadConfig.backend, choices=BACKENDS,
                    help="the engine family to score on, as serve.py --backend (default auto: vLLM where installed)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--modes-dir", action="append", default=None)
    ap.add_argument("--gptq", default=None, help="GPTQ checkpoint overriding the preset's")
    ap.add_argument("--dtype", default=LoadConfig.dtype, choices=DTYPES,
                    help="the reference dtype, as serve.py --dtype (default auto: the device's native 16-bit type)")
    ap.add_argument("--out", default=str(REPORTS_DIR))
    ap.add_argument("--policy", default=None,
                    help="judge with this policy's quality tolerances, as the server running it does "
                         "(default: the defaults a policy without a quality block has)")
    ap.add_argument("--merge", default=None, metavar="REPORT",
                    help="score nothing: add the runs of REPORT (written by this command elsewhere, e.g. on another "
                         "machine) to the report for its model and engine in --out")
    args = ap.parse_args(argv)
    cap_kernels()  # as the server does: before anything computes, the engines it builds inheriting them
    if args.merge:
        path = None
        for run in runs(json.loads(Path(args.merge).read_text())):
            path = write(run, Path(args.out))
        print(f"report: {path}")
        return 0
    modes_dirs = [Path(d) for d in (args.modes_dir or [DEFAULT_MODES_DIR])]
    quality = QualityPolicy()
    if args.policy:
        quality = load_policy(args.policy, [m.name for m in load_modes(*modes_dirs)]).quality
    report = run_gate(args.model, modes_dirs, tuple(t for t in args.tasks.split(",") if t), args.limit, quality,
                      gptq=args.gptq, backend=args.backend, dtype=args.dtype)
    path = write(report, Path(args.out))
    print(render(report))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
