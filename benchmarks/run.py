"""The controller against every static mode and the oracle, on the reference workloads, in one run.

Starts ``serve.py`` (extra server flags after ``--``) and sends the same mixed trace of the reference design's
six workloads (short/short, short/long, long/short, long/long, shared-prefix chat, memory pressure; token
counts times --scale) to:

  1. every static mode, pinned (the quality gate off, so every mode is measured), and fp16 once more
     ("fp16 again"): the per-request best of two runs of one mode is what an oracle gains from run-to-run
     noise alone (a lower bound: the oracle takes the best of several modes), a gain no router can get;
  2. the rule policies (policies/fastest.yaml, the default; policies/least-energy.yaml, the same lists ordered by
     energy within a latency slack; policies/batch-first.yaml; policies/paper.yaml, the reference design's table)
     and the learned policy (policies/learned.yaml, online from scratch, --learned-passes times over the trace),
     with the quality gate report loaded;
  3. the learned policy again, warm-started from the static runs' records (one pass);
  4. the oracle: per request, the fastest static mode that passes the quality gate.

Each run reads its prompts from its own stretch of real text, so prefix caches never carry over between
runs. Per request it records TTFT, latency, tokens, energy (measured or estimated), mode and reason; it
writes a summary JSON, every record (gzipped, beside it), a markdown table, and PNG plots (latency CDF,
J/token, mode mix, regret) to benchmarks/results/. --sweep adds the prefix-reuse sweeps (shared-prefix
length, suffix diversity, concurrency, arrival pattern) for fp16, prefix_cache, the rule policy and the
learned policy.

    python benchmarks/run.py                         # demo model, CPU-sized (--scale 0.25, 100 requests)
    python benchmarks/run.py --model /path/llama --scale 1 --tag h200 -- --max-model-len 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
from tqdm import tqdm

from modeswitch.bench import report
from modeswitch.bench.client import send
from modeswitch.bench.workloads import REFERENCE, TextSource, arrivals, prefix_reuse, trace
from modeswitch.serving.launcher import ROOT, start_server
from modeswitch.modes import load_modes
from modeswitch.resources import shipped_report



def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--scale", type=float, default=0.25, help="multiply the reference token counts (1 = as published)")
    p.add_argument("--requests", type=int, default=100, help="requests in the mixed trace")
    p.add_argument("--learned-passes", type=int, default=2, help="times the cold learned policy runs the trace")
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop clients for the main comparison")
    p.add_argument("--modes", default=",".join(m.name for m in load_modes()),
                   help="static modes to pin (comma-separated; default: the reference modes)")
    p.add_argument("--gate-report", default=None,
                   help="quality gate report (default: the shipped evals/reports/<model>-<engine>.json)")
    p.add_argument("--sweep", action="store_true", help="also run the prefix-reuse sweeps")
    p.add_argument("--no-noise-run", action="store_true", help="skip the second fp16 run (the noise floor)")
    p.add_argument("--sweep-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args, server_args = p.parse_known_args()
    return args, [a for a in server_args if a != "--"]


#: quality gate verdicts that let a mode serve
PASSING = ("pass", "not in report")
#: the shipped rule policies every run compares, by file stem
RULE_POLICIES = ("fastest", "least-energy", "batch-first", "paper")


class Bench:
    def __init__(self, url: str, source: TextSource, args) -> None:
        self.url, self.source, self.args = url, source, args
        self.run_index = 0
        self.shapes = [s.scaled(args.scale) for s in REFERENCE]

    def next_trace(self):
        self.run_index += 1
        return trace(self.source, self.shapes, self.args.requests, run=self.run_index, seed=self.args.seed)

    def send(self, name: str, slots, mode: str | None = None, concurrency: int | None = None):
        with tqdm(total=len(slots), desc=name, unit="req", leave=False) as bar:
            return send(self.url, slots, mode, concurrency or self.args.concurrency, progress=bar.update)

    def gate(self, path: Path, tmp: Path) -> dict[str, str]:
        """Load the quality gate report at ``path`` (a copy in ``tmp``, which the server's admin routes may
        read) and return each mode's verdict; with no report there, every mode passes."""
        cards = requests.get(self.url + "/v1/modes", timeout=30).json()["modes"]
        if not path.is_file():
            return {m["name"]: "pass" for m in cards}
        copy = shutil.copy(path, tmp / path.name)
        requests.post(self.url + "/admin/gate", json={"path": str(copy)}, timeout=60).raise_for_status()
        cards = requests.get(self.url + "/v1/modes", timeout=30).json()["modes"]
        return {m["name"]: m.get("quality_gate", "pass") for m in cards}

    def policy(self, path: Path) -> dict:
        resp = requests.post(self.url + "/admin/policy", json={"path": str(path)}, timeout=60)
        resp.raise_for_status()
        return resp.json()


def learned_policy(tmp: Path, name: str, extra: str) -> Path:
    path = tmp / f"{name}.yaml"
    text = (ROOT / "policies" / "learned.yaml").read_text().replace("name: learned", f"name: {name}")
    path.write_text(text + extra)
    return path


def main() -> int:
    args, server_args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="modeswitch-bench-"))
    static_modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    t0 = time.perf_counter()
    # the policies and the gate report it loads later are written to (or copied into) tmp, which the server's
    # admin routes may read from
    proc, url, log_file = start_server(tmp, "--model", args.model, "--gate-report", "none", "--admin-dir", str(tmp),
                                       *server_args)
    startup_s = time.perf_counter() - t0
    try:
        bench = Bench(url, TextSource(_tokenizer(args.model)), args)
        listing = requests.get(url + "/v1/modes", timeout=30).json()
        cards = {m["name"]: m for m in listing["modes"]}
        static_modes = [m for m in static_modes if cards.get(m, {}).get("status") == "available"]
        runs: dict[str, list] = {}
        for mode in static_modes:
            runs[f"mode:{mode}"] = bench.send(f"mode:{mode}", bench.next_trace(), mode)
            tqdm.write(_line(f"mode:{mode}", runs[f"mode:{mode}"]))
        if "fp16" in static_modes and not args.no_noise_run:
            runs["fp16 again"] = bench.send("fp16 again", bench.next_trace(), "fp16")
            tqdm.write(_line("fp16 again", runs["fp16 again"]))

        holds_for = listing["quality_gate"]["holds_for"]  # the kernels serving the modes
        gate_path = Path(args.gate_report) if args.gate_report else shipped_report(args.model, holds_for)
        verdicts = bench.gate(gate_path, tmp)
        allowed = [m for m in static_modes if verdicts[m] in PASSING]

        for policy in RULE_POLICIES:
            bench.policy(ROOT / "policies" / f"{policy}.yaml")
            runs[policy] = bench.send(policy, bench.next_trace())
            tqdm.write(_line(policy, runs[policy]))

        bench.policy(learned_policy(tmp, "learned", f"state: {tmp / 'learned_state.json'}\n"))
        runs["learned"] = []
        for i in range(args.learned_passes):
            runs["learned"] += bench.send(f"learned pass {i + 1}", bench.next_trace())
        tqdm.write(_line("learned", runs["learned"]))

        warm = tmp / "warm_start.json"
        warm.write_text(json.dumps({"records": [r for k, v in runs.items() if k.startswith("mode:") for r in v]}))
        bench.policy(learned_policy(tmp, "learned-warm", f"warm_start: {warm}\n"))
        runs["learned-warm"] = bench.send("learned-warm", bench.next_trace())
        tqdm.write(_line("learned-warm", runs["learned-warm"]))

        best = report.oracle({k[5:]: v for k, v in runs.items() if k.startswith("mode:")}, allowed)
        runs["oracle"] = best
        sweep = run_sweep(bench, tmp) if args.sweep else None
        admin = requests.get(url + "/admin/policy", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    rows = report.compare(runs)
    quality = {}
    for name, records in runs.items():
        used = {r["mode"] for r in records if r.get("ok")}
        failing = sorted(m for m in used if verdicts.get(m) not in PASSING)
        quality[name] = f"uses {', '.join(failing)}: fails the gate" if failing else "all modes pass"
    n = args.requests
    # per slot, the better of two fp16 runs: the oracle's "gain" from noise alone
    noise = report.oracle({"a": runs["mode:fp16"], "b": runs["fp16 again"]}, ["a", "b"]) if "fp16 again" in runs else []
    last_pass = {"learned (last pass)": runs["learned"][-n:]}
    statics = [r for r in rows if r["run"].startswith("mode:") and r["run"][5:] in allowed and "mean_latency_s" in r]
    best_static = min(statics, key=lambda r: r["mean_latency_s"]) if statics else None
    targets = {
        "best_static": best_static["run"] if best_static else None,
        "learned_mean_s": report.summarize(runs["learned"]).get("mean_latency_s"),
        "learned_last_pass_mean_s": report.summarize(last_pass["learned (last pass)"]).get("mean_latency_s"),
        "learned_warm_mean_s": report.summarize(runs["learned-warm"]).get("mean_latency_s"),
        "best_static_mean_s": best_static["mean_latency_s"] if best_static else None,
        "oracle_mean_s": report.summarize(best).get("mean_latency_s"),
        "noise_oracle_mean_s": report.summarize(noise).get("mean_latency_s"),
        "noise_share_of_oracle_gain": report.oracle_gain_share({**runs, "noise": noise}, "noise"),
        "oracle_gain_share": {k: report.oracle_gain_share({**runs, **last_pass}, k)
                              for k in ("learned", "learned (last pass)", "learned-warm", *RULE_POLICIES)},
        "decision_us_p50": {k: report.summarize(runs[k]).get("decision_us_p50")
                            for k in (*RULE_POLICIES, "learned", "learned-warm")},
    }
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = report.results_stem(out, f"controller_{Path(args.model).name}", args.tag)
    pngs = report.plots(out, stem.name, runs, "learned", best)
    machine = report.processor()
    result = {"date": datetime.now(timezone.utc).isoformat(), "model": args.model, "scale": args.scale,
              "requests": args.requests, "learned_passes": args.learned_passes, "concurrency": args.concurrency,
              "shapes": [vars(s) for s in bench.shapes], "machine": platform.platform(),
              "processor": machine,
              "server_args": server_args, "startup_s": startup_s, "gate_report": str(gate_path) if gate_path.is_file() else None,
              "quality_verdicts": verdicts, "allowed_for_oracle": allowed, "targets": targets,
              "learned_state": admin, "rows": rows, "sweep": sweep,
              "records": runs}  # report.save_results writes these to <stem>.records.json.gz, the rest to <stem>.json
    md = [f"# Controller vs static modes vs oracle — {args.model}, {machine}, {stamp}", "",
          f"Mixed trace of {args.requests} requests over the six reference workloads at scale {args.scale} "
          f"({', '.join(f'{s.name} {s.prompt_tokens}->{s.max_tokens}' for s in bench.shapes)}), "
          f"closed loop, concurrency {args.concurrency}. The learned policy ran the trace {args.learned_passes} "
          f"times from scratch (its row covers all {len(runs['learned'])} requests). Energy: "
          f"{rows[0].get('energy_source', '-')}. \"fp16 again\" is fp16 pinned a second time: the per-request "
          f"best of the two fp16 runs (noise_oracle_mean_s below) shows how much of the oracle's gain run-to-run "
          f"noise alone provides.", "", report.markdown(rows, quality), "",
          "## Targets", "", "```", json.dumps(targets, indent=1), "```", ""]
    if sweep:
        md += ["## Prefix-reuse sweeps (mean latency s)", "", sweep_markdown(sweep), ""]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    report.save_results(out, f"controller_{Path(args.model).name}", args.tag, result, "\n".join(md) + "\n")
    print("\n".join(md[:len(rows) + 12]))
    print(f"wrote {stem}.json, .md, .records.json.gz and {len(pngs)} plots")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from modeswitch.weights.presets import local_or_hub, resolve_preset

    return AutoTokenizer.from_pretrained(local_or_hub(resolve_preset(model).fp16, "tokenizer"))


def _line(name: str, records: list) -> str:
    s = report.summarize(records)
    return (f"{name:28s} mean {s.get('mean_latency_s', float('nan')):.3f} s  p99 {s.get('p99_latency_s', float('nan')):.3f} s"
            f"  J/token {s.get('j_per_token', float('nan')):.3g}  errors {s['errors']}  modes {s.get('mode_mix')}")


SWEEP = [  # (label, prefix fraction, distinct prefixes, concurrency, arrival)
    ("prefix 25%", 0.25, 1, 1, "closed"), ("prefix 50%", 0.5, 1, 1, "closed"), ("prefix 90%", 0.9, 1, 1, "closed"),
    ("4 prefixes", 0.75, 4, 1, "closed"), ("16 prefixes", 0.75, 16, 1, "closed"),
    ("concurrency 4", 0.75, 1, 4, "closed"), ("poisson", 0.75, 1, 1, "poisson"), ("bursts of 4", 0.75, 1, 1, "burst"),
]


def run_sweep(bench: Bench, tmp: Path) -> dict:
    """Prefix-reuse variations around 'one conversation, 75 % shared prefix, one client, closed loop'."""
    shape = next(s for s in bench.shapes if s.name == "shared_prefix")
    policies = {"mode:fp16": "fp16", "mode:prefix_cache": "prefix_cache", "paper": None, "learned": None}
    results: dict = {}
    for label, fraction, prefixes, conc, arrival in SWEEP:
        results[label] = {}
        for name, pinned in policies.items():
            if name in ("paper", "learned"):
                bench.policy(ROOT / "policies" / "paper.yaml" if name == "paper"
                             else learned_policy(tmp, "learned", f"state: {tmp / 'learned_state.json'}\n"))
            bench.run_index += 1
            slots = prefix_reuse(bench.source, bench.args.sweep_requests, bench.run_index, shape.prompt_tokens,
                                 shape.max_tokens, fraction, prefixes, seed=bench.args.seed)
            # open loop at about the rate one fp16 client sustains, so queues form but do not explode
            slots = arrivals(slots, arrival, rate=0.8 / max(shape.max_tokens * 0.05, 0.1))
            records = bench.send(f"{label} {name}", slots, pinned, conc)
            results[label][name] = report.summarize(records)
    return results


def sweep_markdown(sweep: dict) -> str:
    names = list(next(iter(sweep.values())))
    lines = ["| variation | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for label, per in sweep.items():
        lines.append(f"| {label} | " + " | ".join(report.number(per[n].get("mean_latency_s")) for n in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
