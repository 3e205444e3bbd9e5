"""Rewrite benchmarks/results/README.md: one table per benchmark, built from the summary JSONs in that directory.

Each benchmark writes ``<benchmark>[_<tag>].json`` and ``.md`` there (``modeswitch.bench.report.save_results``),
overwriting its previous run of the same variant; git history keeps the earlier ones. The markdown files hold
each run's full table; this digest puts the numbers a reader looks for first (a policy against fp16 or the best
static mode, ModeSwitch against vLLM's own server, the chaos run's stranded requests and 5xx answers) side by
side with each run's date and machine, so one page says what was last measured where.

It reads the summary JSONs only (never the per-request ``*.records.json.gz``, never the markdown), so it runs in
a second on a checkout without the benchmarks' dependencies. A summary that lacks a headline field shows "-" in
that cell; one whose benchmark it does not know gets a row with its date and machine. The output depends only
on the JSONs, so running it twice gives the same file. It also draws, from the summaries, what reads better as a
picture: each modes run's latency by mode, and ModeSwitch's mode mix over the changing workload's phases.

    .venv/bin/python benchmarks/digest.py [--results DIR] [--no-plots]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"
Row = dict[str, Any]


def num(value: Any, unit: str = "") -> str | None:
    """Three significant digits, whole numbers from 1000 up (None stays None: a "-" cell)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return f"{value:.0f}{unit}" if abs(value) >= 1000 else f"{value:.3g}{unit}"


def ratio(value: Any) -> str | None:
    return None if not isinstance(value, (int, float)) else f"{value:.2f}x"


def get(data: Any, *keys: Any) -> Any:
    """``data[k1][k2]...``, or None where a level is missing: a summary from an older run may lack a field."""
    for key in keys:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def div(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def geo_mean(values: Any) -> float | None:
    values = [v for v in values or [] if isinstance(v, (int, float)) and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


# ------------------------------------------------------------------ headline rows, one function per benchmark
# Each takes a summary and returns its rows (column -> cell); the columns of a table are those of its rows, in
# the order they first appear.

def controller(s: dict) -> list[Row]:
    rows = {r.get("run"): r for r in s.get("rows") or []}
    best = get(s, "targets", "best_static") or ""
    row: Row = {"fp16 mean s": num(get(rows, "mode:fp16", "mean_latency_s")),
                "best static mode (mean s)": f"{best.removeprefix('mode:')} ({num(get(rows, best, 'mean_latency_s'))})"
                if best else None}
    for run in ("fastest", "least-energy", "batch-first", "paper", "learned", "learned-warm", "oracle"):
        row[f"{run} vs fp16"] = ratio(get(rows, run, "speedup_mean"))
    row["learned's share of the oracle's gain"] = num(get(s, "targets", "oracle_gain_share", "learned"))
    return [row]


def rounds(s: dict) -> list[Row]:
    rows = {r.get("run"): r for r in s.get("rows") or []}
    best = s.get("best_static") or ""
    row: Row = {"best static mode (mean s)": f"{best.removeprefix('mode:')} ({num(get(rows, best, 'mean_s'))})"
                if best else None}
    for run, r in rows.items():
        if run and not run.startswith("mode:"):
            row[f"{run} vs best static"] = ratio(geo_mean(r.get("vs_best_static")))
    return [row]


def vs_vllm(s: dict) -> list[Row]:
    runs = s.get("runs") or []
    reference = next((r.get("server") for r in runs if r.get("flags") is None), None)
    out: dict[str, Row] = {}
    for r in runs:
        if r.get("server") == reference:
            continue
        row = out.setdefault(r.get("server"), {"server": r.get("server"), "against": reference})
        row[f"{r.get('workload')} out tok/s vs vLLM"] = ratio(r.get("tok_s_ratio"))
        row[f"{r.get('workload')} TTFT p50 vs vLLM"] = ratio(r.get("ttft_ratio"))
    return list(out.values())


def modes(s: dict) -> list[Row]:
    rows = []
    for r in s.get("modes") or []:
        row: Row = {"mode": r.get("mode"), "ms/token": num(r.get("ms_per_token")),
                    "ms/token vs fp16": ratio(r.get("ms_per_token_vs_fp16")), "TTFT vs fp16": ratio(r.get("ttft_vs_fp16")),
                    "decode tok/s vs fp16": ratio(r.get("decode_vs_fp16"))}
        for key in sorted((k for k in r if k.startswith("concurrent") and k.endswith("_vs_fp16")),
                          key=lambda k: int(k[10:-8]) if k[10:-8].isdigit() else 0):
            row[f"{key[10:-8]} clients tok/s vs fp16"] = ratio(r[key])
        rows.append(row)
    return rows


def engines(s: dict) -> list[Row]:
    """Rows of (transformers, vLLM) pairs: the ratio is vLLM's over transformers'."""
    pair = lambda r, k: div(get(r, k, 1), get(r, k, 0))  # noqa: E731
    return [{"mode": r.get("mode"), "decode tok/s vLLM vs transformers": ratio(pair(r, "decode_tok_s")),
             "concurrent tok/s vLLM vs transformers": ratio(pair(r, "concurrent_tok_s")),
             "TTFT vLLM vs transformers": ratio(pair(r, "ttft_ms"))} for r in s.get("rows") or []]


def changing(s: dict) -> list[Row]:
    summary = s.get("summary") or {}
    ours = next((k for k, v in (s.get("requests_by_mode") or {}).items() if v), None)
    rows = []
    for server, phases in summary.items():
        row: Row = {"server": f"**{server}**" if server == ours else server}
        for phase, stats in phases.items():
            row[f"{phase} mean s"] = num(get(stats, "mean_s"))
        row["ModeSwitch's speed-up over it"] = (
            ratio(paired_ratio(phases, summary.get(ours))) if ours and server != ours else None)
        row["CPU ms/token"] = num(cpu_per_token(phases.get("overall")))
        rows.append(row)
    return rows


def cpu_per_token(overall: Any) -> float | None:
    """Milliseconds of CPU the server's processes (front ends and engines) spent per generated token: the cores they
    kept busy over the tokens a second. An idle engine that spins on its core counts: its user pays for it too."""
    front, engines = get(overall, "front_cores"), get(overall, "engine_cores")
    if not all(isinstance(c, (int, float)) for c in (front, engines)):
        return None
    return div(1000 * (front + engines), get(overall, "out_tok_s"))


def paired_ratio(theirs: dict, ours: dict) -> float | None:
    """Their overall mean over ours over the runs both have (a pinned row runs only the first of the repeats,
    each beside the adaptive run of the same index: like with like); from the means where a summary has no run
    means."""
    a, b = get(theirs, "overall", "run_means_s"), get(ours, "overall", "run_means_s")
    if isinstance(a, list) and isinstance(b, list) and a and b:
        n = min(len(a), len(b))
        return div(sum(a[:n]), sum(b[:n]))
    return div(get(theirs, "overall", "mean_s"), get(ours, "overall", "mean_s"))


def chaos(s: dict) -> list[Row]:
    summary, kills = s.get("summary") or {}, s.get("kills") or []
    worst = lambda key: max((k[key] for k in kills if isinstance(k.get(key), (int, float))), default=None)  # noqa: E731
    return [{"requests": summary.get("requests"), "stranded": summary.get("stranded"),
             "5xx other than 503": summary.get("unexpected_5xx"),
             "bad requests answered 400": f"{summary.get('bad_requests_answered_400')} of {summary.get('bad_requests')}"
             if "bad_requests" in summary else None,
             "engines killed": len(kills), "death reported in (s, worst)": num(worst("detected_s")),
             "engine back in (s, worst)": num(worst("back_s")),
             "PSS start -> end GB": f"{summary.get('pss_start_gb')} -> {summary.get('pss_end_gb')}"
             if "pss_end_gb" in summary else None, "health at end": summary.get("health_at_end")}]


def cluster(s: dict) -> list[Row]:
    routers = s.get("routers") or {}
    base = routers.get("round_robin") or {}
    rows = [{"router": name, "prefix hit rate": num(r.get("hit_rate")),
             "vs round-robin": ratio(div(r.get("hit_rate"), base.get("hit_rate"))),
             "mean TTFT s": num(r.get("mean_ttft_s")),
             "TTFT vs round-robin": ratio(div(r.get("mean_ttft_s"), base.get("mean_ttft_s"))),
             "out tok/s": num(r.get("out_tok_s")), "answered": f"{r.get('ok')} of {r.get('requests')}"}
            for name, r in routers.items()]
    fault = s.get("fault")
    if isinstance(fault, dict) and fault:
        rows.append({"router": "modeswitch, a replica killed", "prefix hit rate": num(fault.get("hit_rate")),
                     "mean TTFT s": num(fault.get("mean_ttft_s")), "out tok/s": num(fault.get("out_tok_s")),
                     "answered": f"{fault.get('ok')} of {fault.get('requests')}"})
    return rows


def idle_cost(s: dict) -> list[Row]:
    return [{"server flags": " ".join(s.get("flags") or []) or "(default)",
             "CPU % idle (all processes)": num(s.get("total_cpu_pct")), "RSS MiB": num(s.get("total_rss_mib")),
             "ready s": num(s.get("ready_s")), "modes": len(s.get("modes") or []),
             "processes": len(s.get("processes") or [])}]


def staged_start(s: dict) -> list[Row]:
    return [{"start": name, "ready s": num(v.get("ready_s")), "every mode up s": num(v.get("all_up_s")),
             "modes while loading": ", ".join(v.get("modes_while_loading") or []) or "-",
             "ms/token while loading": num(v.get("ms_per_token_while_loading")),
             "ms/token after": num(v.get("ms_per_token_after"))} for name, v in (s.get("variants") or {}).items()]


def openai_fidelity(s: dict) -> list[Row]:
    verdict = s.get("verdict") or {}
    seeded = len(s.get("seeded") or {})
    return [{"engine": engine, "requests": len(s.get("cases") or {}),
             "same as vLLM": f"{v.get('same_as_vllm')} of {v.get('held_to_vllm_text')}",
             "max logprob difference": num(v.get("max_abs_logprob_diff")),
             "seeded sound": f"{v.get('seeded_sound')} of {seeded}"} for engine, v in verdict.items()]


def energy(s: dict) -> list[Row]:
    ratios = [r["ratio"] for r in s.get("rows") or [] if isinstance(r.get("ratio"), (int, float))]
    return [{"meter": s.get("meter"), "pass": s.get("pass"), "blocks": len(s.get("rows") or []),
             "requests' sum / meter": f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else None}]


def gpu_check(s: dict) -> list[Row]:
    modes_ = s.get("modes") or {}
    fp16 = get(modes_, "fp16", "decode_ms_per_token")
    row: Row = {"device": s.get("device_name"), "shape": s.get("shape"), "fp16 decode ms/token": num(fp16)}
    for mode, r in modes_.items():
        if mode != "fp16" and "decode_ms_per_token" in r:
            row[f"{mode} vs fp16"] = ratio(div(r["decode_ms_per_token"], fp16))
    row["errors"] = len(s.get("errors") or {})
    return [row]


def int8_kernels(s: dict) -> list[Row]:
    return [{"linear": f"{r.get('linear')} ({r.get('out')}x{r.get('in')})", "tokens": r.get("tokens"),
             "FBGEMM ms": num(r.get("fbgemm_ms")),
             "oneDNN / FBGEMM": ratio(div(r.get("onednn_ms"), r.get("fbgemm_ms"))),
             "float32 / FBGEMM": ratio(div(r.get("float32_ms"), r.get("fbgemm_ms")))} for r in s.get("rows") or []]


def gate(s: dict) -> list[Row]:
    rows = []
    for mode, tasks in (s.get("modes") or {}).items():
        row: Row = {"mode": mode}
        for task, t in tasks.items():
            delta = (f"{t['delta_pp']:+.1f} pp" if isinstance(t.get("delta_pp"), (int, float)) else
                     f"{t['delta_pct']:+.1f} %" if isinstance(t.get("delta_pct"), (int, float)) else "")
            row[task] = f"{num(t.get('value'))} ({delta})" if delta else num(t.get("value"))
        row["gate"] = "pass" if tasks and all(t.get("pass") for t in tasks.values()) else "fail"
        rows.append(row)
    return rows


# (benchmark name prefix, section title, what the ratios mean, headline rows); the order of the page
KINDS: list[tuple[str, str, str, Callable[[dict], list[Row]]]] = [
    ("controller", "Controller: policies against static modes and the oracle (`benchmarks/run.py`)",
     "Mean-latency speed-up over the fp16 mode pinned, same trace (> 1x: faster).", controller),
    ("rounds", "Policies against the best static mode, interleaved rounds (`benchmarks/rounds.py`)",
     "Mean latency over the best static mode's in the same round, geometric mean over rounds (< 1x: faster).",
     rounds),
    ("vs_vllm", "ModeSwitch against vLLM's own server (`benchmarks/vs_vllm.py`)",
     "Against the run's first vLLM server: output tok/s (> 1x: more) and TTFT p50 (< 1x: sooner).", vs_vllm),
    ("changing", "A changing workload against vLLM's static configurations (`benchmarks/changing.py`)",
     "Mean latency per phase; the speed-up is the server's overall mean over ModeSwitch's (bold), over the runs "
     "both have; CPU ms/token: the CPU time its processes spent per generated token, over the whole trace.",
     changing),
    ("modes", "Modes side by side (`benchmarks/modes.py`)",
     "Each mode against the fp16 mode on the same server: ms/token and TTFT (< 1x: faster), tok/s (> 1x: more).",
     modes),
    ("engines", "transformers against vLLM engines (`benchmarks/engines.py`)",
     "vLLM's over transformers' (tok/s > 1x: vLLM more; TTFT < 1x: vLLM sooner).", engines),
    ("chaos", "Chaos: engines killed under load (`benchmarks/chaos.py`)",
     "Stranded requests and 5xx answers other than 503 should be 0.", chaos),
    ("cluster", "Cluster routing (`benchmarks/cluster.py`)",
     "Prefix hit rate (> 1x: more) and mean TTFT (< 1x: sooner) against round-robin.", cluster),
    ("openai_fidelity", "OpenAI parameter fidelity against vLLM (`benchmarks/openai_fidelity.py`)",
     "The same requests to vLLM's server and to each ModeSwitch engine, float32 weights: the answers the logits "
     "decide against vLLM's (seeded ones too on the vLLM engine, which samples as vLLM does), and seeded answers "
     "that repeat and stay within their sampling support.", openai_fidelity),
    ("idle_cost", "Idle cost (`benchmarks/idle_cost.py`)", "The idle server, every process.", idle_cost),
    ("staged_start", "Serving during a staged start (`benchmarks/staged_start.py`)",
     "Time to ready and to every mode up, and decode speed while modes load.", staged_start),
    ("energy", "Energy attribution (`benchmarks/energy_check.py`)",
     "Per-request energy summed over a block against the meter's delta (pass: within 5 %).", energy),
    ("gpu_check", "GPU decode path (`benchmarks/gpu_check.py`)", "Decode ms/token against fp16 (< 1x: faster).",
     gpu_check),
    ("int8_kernels", "One W8A8 int8 linear: vLLM's oneDNN matmul against FBGEMM (`benchmarks/int8_kernels.py`)",
     "Time a call, oneDNN's and float32's over FBGEMM's (> 1x: FBGEMM faster).", int8_kernels),
    ("gate", "Quality gate reports", "Each task's score and its change against the reference mode.", gate),
]


def kind_of(summary: dict) -> tuple[str, str, str, Callable[[dict], list[Row]]] | None:
    name = summary.get("benchmark") or summary["_stem"]
    return next((k for k in KINDS if name == k[0] or name.startswith(k[0] + "_")), None)


def machine(summary: dict) -> str | None:
    m = summary.get("processor") or summary.get("machine")
    if isinstance(m, dict):  # modes.py: platform (Linux-<kernel>-<arch>-with-<libc>), cpus, gpu
        arch = next((p for p in str(m.get("platform")).split("-") if p in ("x86_64", "aarch64", "arm64")), None)
        m = m.get("gpu") or f"{arch or m.get('platform')}, {m.get('cpus')} CPUs"
    return m or summary.get("device_name")


def load(results: Path) -> list[dict]:
    """Every summary JSON in ``results``, by file name; ``_stem`` is its file name without the suffix."""
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            out.append({**data, "_stem": path.stem})
    return out


def table(rows: list[Row]) -> list[str]:
    columns = list(dict.fromkeys(c for r in rows for c in r))
    cell = lambda v: "-" if v is None or v == "" else str(v).replace("|", "\\|")  # noqa: E731
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows])


def section(title: str, note: str, summaries: list[dict], headline: Callable[[dict], list[Row]] | None,
            results: Path) -> list[str]:
    rows = []
    for s in summaries:
        stem = s["_stem"]
        run = f"[{stem}]({stem}.md)" if (results / f"{stem}.md").is_file() else stem
        common = {"run": run, "date": str(s.get("date") or "")[:10] or None, "machine": machine(s)}
        try:
            got = headline(s) if headline else []
        except Exception as e:  # a summary of another shape: say so, keep the page
            got = [{"note": f"headline fields not read ({type(e).__name__})"}]
        rows += [{**common, **r} for r in got] or [common]
    lines = [f"## {title}", "", note, "", *table(rows), ""]
    for s in summaries:  # the plots beside each run: <stem>_<kind>.png
        lines += [f"![{s['_stem']} {kind}]({s['_stem']}_{kind}.png)" for kind in PLOTS
                  if (results / f"{s['_stem']}_{kind}.png").is_file()]
    return lines + ([""] if lines[-1] != "" else [])


def build(results: Path = RESULTS, plots: bool = True) -> str:
    """The README's text for the summaries in ``results`` (and, with ``plots``, the PNGs drawn from them)."""
    summaries = load(results)
    if plots:
        draw(results, summaries)
    groups: dict[int, list[dict]] = {}
    for s in summaries:
        kind = kind_of(s)
        groups.setdefault(KINDS.index(kind) if kind else len(KINDS), []).append(s)
    lines = ["# Benchmark results", "",
             "_Generated by `benchmarks/digest.py` from the summary JSONs in this directory; do not edit: after a "
             "benchmark run, `.venv/bin/python benchmarks/digest.py` rewrites it._", "",
             "Each benchmark writes `<benchmark>[_<tag>].json` (its summary: what this page reads) and `.md` (its "
             "full table) here, overwriting its previous run of the same variant (tag); git history keeps the "
             "earlier runs. Per-request records, where a benchmark keeps them, are beside the summary in "
             "`<benchmark>[_<tag>].records.json.gz`. Ratios are within one run: machines here are noisy, compare "
             "runs through them, not through absolute numbers. A \"-\" is a field the run did not record.", ""]
    for index in sorted(groups):
        title, note, headline = (KINDS[index][1:] if index < len(KINDS)
                                 else ("Other results", "Benchmarks this digest has no headline for.", None))
        lines += section(title, note, groups[index], headline, results)
    return "\n".join(lines).rstrip("\n") + "\n"


# ------------------------------------------------------------------ plots drawn from summaries

PLOTS = ("latency_cdf", "j_per_token", "mode_mix", "regret", "latency_by_mode")  # <stem>_<kind>.png, linked


def draw(results: Path, summaries: list[dict]) -> list[Path]:
    """``<stem>_latency_by_mode.png`` for each modes run and ``<stem>_mode_mix.png`` for each changing-workload
    run: the two summaries whose point is a shape (which mode is fast, where the load went) more than a number.
    A summary it cannot draw is skipped with a message; the README is still written."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for s in summaries:
        kind = (kind_of(s) or ("",))[0]
        if kind not in DRAWN:
            continue
        plot, suffix = DRAWN[kind]
        try:
            fig = plot(s)
        except Exception as e:
            print(f"{s['_stem']}: no {suffix} plot ({type(e).__name__}: {e})")
            continue
        if fig is not None:
            written.append(_save(fig, results / f"{s['_stem']}_{suffix}.png"))
    return written


def latency_by_mode(s: dict):
    import matplotlib.pyplot as plt

    rows = [r for r in s.get("modes") or [] if isinstance(r.get("ms_per_token"), (int, float))]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.4 * len(rows) + 1.5), sharey=True)
    names = [r["mode"] for r in rows]
    axes[0].barh(names, [r["ms_per_token"] for r in rows])
    axes[0].set(xlabel="ms per output token, 1 client", title="decode")
    axes[1].barh(names, [r.get("ttft_ms") or 0 for r in rows], color="tab:orange")
    axes[1].set(xlabel="ms to the first token", title="TTFT")
    axes[0].invert_yaxis()
    fig.suptitle(f"Latency by mode: {s.get('model')}, {machine(s)}, {str(s.get('date'))[:10]}", fontsize=9)
    return fig


def mode_mix(s: dict):
    import matplotlib.pyplot as plt

    ours = next((k for k, v in (s.get("requests_by_mode") or {}).items() if v), None)
    phases = {p: v.get("modes") or {} for p, v in (get(s, "summary", ours) or {}).items() if p != "overall"}
    modes_ = sorted({m for mix in phases.values() for m in mix})
    if not modes_:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0] * len(phases)
    for m in modes_:
        counts = [phases[p].get(m, 0) for p in phases]
        ax.bar(list(phases), counts, bottom=bottom, label=m)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set(ylabel="requests", title=f"{ours}: modes per phase of the changing workload")
    ax.legend(fontsize=7)
    return fig


DRAWN = {"modes": (latency_by_mode, "latency_by_mode"), "changing": (mode_mix, "mode_mix")}  # kind: what, file suffix


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})  # no version string: the same summary, the same bytes
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--no-plots", action="store_true", help="write the README only")
    args = ap.parse_args()
    text = build(args.results, plots=not args.no_plots)
    (args.results / "README.md").write_text(text)
    print(f"wrote {args.results / 'README.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
