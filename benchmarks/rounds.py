"""Policies against static modes in interleaved rounds: the controller comparison with its noise measured.

``benchmarks/run.py`` runs each contender once, one after another; on a shared 2-core machine two runs of
the same mode differ by up to 7 % and one policy's two passes by 14 %, more than the differences it is
meant to show. This runs the same contenders (pinned static modes, rule policies, the learned policy from
cold) in R rounds, each round over every contender in an order rotated by one, each run on its own trace
(same shapes, fresh text), and reports per contender the mean over rounds, each round's mean, and per round
the ratio to the best static mode of that same round, so slow spells of the machine cancel out in the
ratios. The quality gate is on (the shipped report), as in run.py.

    python benchmarks/rounds.py --rounds 3 --concurrency 4 --requests 60 --tag avx2-conc4 -- --backend vllm
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import requests
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import PASSING, Bench, _tokenizer, learned_policy  # noqa: E402

from modeswitch.bench import report  # noqa: E402
from modeswitch.bench.workloads import TextSource, rotated_rounds  # noqa: E402
from modeswitch.serving.launcher import ROOT, start_server  # noqa: E402
from modeswitch.resources import shipped_report  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=60, help="requests in each run's trace")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="fp16,prefix_cache,speculative", help="static modes to pin")
    p.add_argument("--policies", default="batch-first,paper", help="rule policies (policies/NAME.yaml)")
    p.add_argument("--learned-passes", type=int, default=2, help="traces the learned policy runs from cold a round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args, server_args = p.parse_known_args()
    return args, [a for a in server_args if a != "--"]


def main() -> int:
    args, server_args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="modeswitch-rounds-"))
    proc, url, _ = start_server(tmp, "--model", args.model, "--gate-report", "none", "--admin-dir", str(tmp),
                                *server_args)
    try:
        bench = Bench(url, TextSource(_tokenizer(args.model)), args)
        listing = requests.get(url + "/v1/modes", timeout=30).json()
        available = {m["name"] for m in listing["modes"] if m["status"] == "available"}
        verdicts = bench.gate(shipped_report(args.model, listing["quality_gate"]["holds_for"]), tmp)
        statics = [m for m in args.modes.split(",") if m in available and verdicts[m] in PASSING]
        contenders = [f"mode:{m}" for m in statics] + args.policies.split(",") + ["learned"]
        means: dict[str, list[float]] = {c: [] for c in contenders}
        mixes: dict[str, dict[str, int]] = {c: {} for c in contenders}
        records: dict[str, list[list[dict]]] = {c: [] for c in contenders}
        for r, name in rotated_rounds(contenders, args.rounds):
            records[name].append(run_one(bench, tmp, name, r, args.learned_passes))
            summary = report.summarize(records[name][-1])
            means[name].append(summary["mean_latency_s"])
            for mode, n in summary["mode_mix"].items():
                mixes[name][mode] = mixes[name].get(mode, 0) + n
            tqdm.write(f"round {r + 1} {name:24s} mean {means[name][-1]:.3f} s")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    best = min((f"mode:{m}" for m in statics), key=lambda c: statistics.fmean(means[c]))
    rows = [{"run": c, "mean_s": statistics.fmean(v), "rounds_s": v,
             "vs_best_static": [x / b for x, b in zip(v, means[best])],
             "vs_round_best_static": [x / min(means[f"mode:{m}"][i] for m in statics) for i, x in enumerate(v)],
             "modes": mixes[c]} for c, v in means.items()]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    result = {"date": datetime.now(timezone.utc).isoformat(), "model": args.model, "processor": report.processor(),
              "server_args": server_args, "args": vars(args), "best_static": best, "rows": rows,
              "records": records}  # per contender, per round: each request (mode, reason, timings, features)
    md = [f"# Policies vs static modes in {args.rounds} interleaved rounds — {args.model}, {report.processor()}, "
          f"{stamp}", "",
          f"Each round runs every contender once on its own {args.requests}-request trace (the controller "
          f"benchmark's six workloads at scale {args.scale}), closed loop at concurrency {args.concurrency}, in "
          f"an order rotated by one a round; the learned policy starts cold each round and runs "
          f"{args.learned_passes} traces. Quality gate on. Ratios: to the best static mode over all rounds "
          f"({best}) in the same round, and to the fastest static mode of each round.", "",
          "| run | mean s | each round s | vs best static, each round | geo. mean | vs round's fastest static | modes used |",
          "|---|---|---|---|---|---|---|"]
    for row in rows:
        md.append(f"| {row['run']} | {row['mean_s']:.2f} | {' / '.join(f'{x:.2f}' for x in row['rounds_s'])} | "
                  f"{' / '.join(f'{x:.2f}x' for x in row['vs_best_static'])} | "
                  f"{statistics.geometric_mean(row['vs_best_static']):.3f}x | "
                  f"{' / '.join(f'{x:.2f}x' for x in row['vs_round_best_static'])} | "
                  f"{', '.join(f'{m} {n}' for m, n in sorted(row['modes'].items(), key=lambda kv: -kv[1]))} |")
    stem = report.save_results(out, f"rounds_{Path(args.model).name}", args.tag, result, "\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {stem}.json and .md")
    return 0


def run_one(bench: Bench, tmp: Path, name: str, round_index: int, learned_passes: int) -> list[dict]:
    """One contender's run: a pinned mode, a rule policy, or the learned policy from cold (a new state file)."""
    if name.startswith("mode:"):
        return bench.send(f"{name} r{round_index + 1}", bench.next_trace(), name[5:])
    if name == "learned":
        bench.policy(learned_policy(tmp, "learned", f"state: {tmp / f'learned_state_{round_index}.json'}\n"))
        return [r for i in range(learned_passes)
                for r in bench.send(f"learned r{round_index + 1} pass {i + 1}", bench.next_trace())]
    bench.policy(ROOT / "policies" / f"{name}.yaml")
    return bench.send(f"{name} r{round_index + 1}", bench.next_trace())


if __name__ == "__main__":
    raise SystemExit(main())
