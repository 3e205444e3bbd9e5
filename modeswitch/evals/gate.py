"""The quality gate: every mode scored with lm-eval, compared with fp16, written as a report the router enforces.

    python -m modeswitch.evals.gate --model demo [--limit 200] [--tasks jargon_cloze,jargon_ppl,jargon_copy]

Scoring tasks (multiple_choice, loglikelihood, loglikelihood_rolling) depend only on a mode's weights, so
they run once per weights variant and every mode on those weights shares the result; generate_until
tasks run on every mode, through its own engine. Deltas vs fp16: accuracy-like metrics (higher is
better, in [0, 1]) in percentage points; perplexity-like metrics (lower is better) as a relative change
in percent. Pass/fail uses the tolerance in the policy's ``quality`` block (defaults below).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..modes import DEFAULT_MODES_DIR, load_modes
from ..resources import REPORTS_DIR
from .run import TASKS, evaluate, task_manager

SCORING = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
DEFAULT_TOLERANCE = {"max_drop_pp": 1.0, "max_ppl_increase_pct": 10.0}


def task_kinds(tasks) -> dict[str, dict]:
    """Per task: output type, primary metric key (``metric,filter``) and whether higher is better."""
    from lm_eval.tasks import get_task_dict

    tdict = get_task_dict(list(tasks), task_manager())
    kinds = {}
    for name, task in tdict.items():
        cfg = task.config
        metric = cfg.metric_list[0]["metric"]
        filters = cfg.filter_list or []
        filter_name = filters[0]["name"] if filters else "none"
        kinds[name] = {"output_type": cfg.output_type, "metric": f"{metric},{filter_name}",
                       "higher_is_better": bool(task.higher_is_better().get(metric, True))}
    return kinds


def compare(value: float, stderr, base: float, higher_is_better: bool, tol: dict) -> dict:
    if higher_is_better:
        delta = (float(value) - float(base)) * 100
        return {"delta_pp": round(delta, 2), "pass": bool(delta >= -tol["max_drop_pp"])}
    delta = (float(value) / float(base) - 1) * 100
    return {"delta_pct": round(delta, 2), "pass": bool(delta <= tol["max_ppl_increase_pct"])}


def run_gate(model: str, modes_dirs, tasks=TASKS, limit: int | None = None, tolerance: dict | None = None,
             gptq: str | None = None, progress=print) -> dict:
    from .adapter import ModeSwitchLM

    tol = {**DEFAULT_TOLERANCE, **(tolerance or {})}
    kinds = task_kinds(tasks)
    scoring = [t for t, k in kinds.items() if k["output_type"] in SCORING]
    generating = [t for t in kinds if t not in scoring]
    started = time.perf_counter()
    by_weights: dict[str, dict] = {}
    modes: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    for spec in load_modes(*modes_dirs):
        t0 = time.perf_counter()
        try:
            lm = ModeSwitchLM(model=model, spec=spec, gptq=gptq)
        except RuntimeError as exc:
            unavailable[spec.name] = str(exc)
            progress(f"gate: {spec.name}: unavailable ({exc})")
            continue
        try:
            if scoring and spec.weights not in by_weights:
                by_weights[spec.weights] = evaluate(lm, scoring, limit)["results"]
            results = dict(by_weights.get(spec.weights, {}))
            if generating:
                results.update(evaluate(lm, generating, limit)["results"])
        finally:
            lm.pool.close()
        modes[spec.name] = {t: {"metric": kinds[t]["metric"], "value": float(results[t][kinds[t]["metric"]]),
                                "stderr": _num(results[t].get(kinds[t]["metric"].replace(",", "_stderr,", 1)))}
                            for t in kinds}
        progress(f"gate: {spec.name}: " + ", ".join(f"{t} {v['value']:.4g}" for t, v in modes[spec.name].items())
                 + f" ({time.perf_counter() - t0:.0f} s)")
    if "fp16" not in modes:
        raise RuntimeError("the fp16 mode is the reference and must be available for the gate")
    for name, per_task in modes.items():
        for task, entry in per_task.items():
            entry.update(compare(entry["value"], entry["stderr"], modes["fp16"][task]["value"],
                                 kinds[task]["higher_is_better"], tol))
    import lm_eval
    import torch
    import transformers

    return {"model": model, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "limit": limit,
            "tolerance": tol, "tasks": kinds, "modes": modes, "unavailable": unavailable,
            "seconds": round(time.perf_counter() - started, 1),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "lm_eval": lm_eval.__version__}}


def _num(x):
    return float(x) if isinstance(x, (int, float)) else None


def render(report: dict) -> str:
    tasks = list(report["tasks"])
    lines = [f"# Quality gate: {report['model']} ({report['date']})", "",
             f"Limit {report['limit'] or 'all'} documents per task; tolerance: accuracy drop <= "
             f"{report['tolerance']['max_drop_pp']} pp, perplexity increase <= "
             f"{report['tolerance']['max_ppl_increase_pct']} %. Took {report['seconds']:.0f} s.", "",
             "| mode | " + " | ".join(f"{t} ({report['tasks'][t]['metric'].split(',')[0]})" for t in tasks)
             + " | gate |", "|---|" + "---|" * (len(tasks) + 1)]
    for mode, per_task in report["modes"].items():
        cells = []
        for t in tasks:
            e = per_task[t]
            err = f" ± {e['stderr']:.3f}" if e["stderr"] is not None else ""
            delta = f"{e['delta_pp']:+.1f} pp" if "delta_pp" in e else f"{e['delta_pct']:+.1f} %"
            cells.append(f"{e['value']:.4g}{err} ({delta}{'' if e['pass'] else ', FAIL'})")
        ok = all(e["pass"] for e in per_task.values())
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {'pass' if ok else 'fail'} |")
    for mode, why in report["unavailable"].items():
        lines.append(f"| {mode} | " + " | ".join("–" for _ in tasks) + f" | unavailable: {why} |")
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: Path = REPORTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(report["model"]).name
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2))
    (out_dir / f"{stem}.md").write_text(render(report))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m modeswitch.evals.gate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--modes-dir", action="append", default=None)
    ap.add_argument("--gptq", default=None, help="GPTQ checkpoint overriding the preset's")
    ap.add_argument("--out", default=str(REPORTS_DIR))
    args = ap.parse_args(argv)
    report = run_gate(args.model, [Path(d) for d in (args.modes_dir or [DEFAULT_MODES_DIR])],
                      tuple(t for t in args.tasks.split(",") if t), args.limit, gptq=args.gptq)
    path = write(report, Path(args.out))
    print(render(report))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
