"""Energy attribution check: per-request energy summed over a run vs the meter's delta, and J/token per mode.

Starts ``serve.py`` (extra server flags after ``--``), then for each mode sends --requests prompts one at a
time (batch 1) and --concurrency at once (batch 8), reading the meter before and after each block. The
meter is NVML's energy counter where there is one (measured), else the server's own estimate read from
``/metrics`` (attributed + idle joules): the check is then only that attribution loses nothing. Pass:
the sum of ``usage.energy_j`` is within 5 % of the meter's delta for every block. Writes JSON and markdown to
benchmarks/results/.

    python benchmarks/energy_check.py --modes fp16,continuous_batching
    python benchmarks/energy_check.py --model /tmp/llama8b --tag h200 -- --max-model-len 2048
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from modeswitch.bench import report
from modeswitch.energy import open_meter
from modeswitch.serving.launcher import ROOT, start_server

PROMPT = ("The Jargon File is a glossary and usage dictionary of slang used by computer programmers. "
          "It describes the hacker culture, its history and its folklore, ") * 6


def server_joules(url: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        if family.name in ("modeswitch_energy_attributed_joules", "modeswitch_energy_idle_joules"):
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return total


def complete(url: str, mode: str, max_tokens: int, i: int) -> dict:
    resp = requests.post(url + "/v1/completions", timeout=900, json={
        "prompt": f"{i}. {PROMPT}", "max_tokens": max_tokens, "temperature": 0, "mode": mode})
    resp.raise_for_status()
    return resp.json()["usage"]


def block(url: str, meter, mode: str, n: int, concurrency: int, max_tokens: int) -> dict:
    read = meter.joules if meter is not None else (lambda: server_joules(url))
    before = read()
    with ThreadPoolExecutor(concurrency) as pool:
        usages = list(pool.map(lambda i: complete(url, mode, max_tokens, i), range(n)))
    delta = read() - before
    attributed = sum(u["energy_j"] for u in usages)
    tokens = sum(u["completion_tokens"] for u in usages)
    return {"mode": mode, "batch": concurrency, "requests": n, "tokens": tokens, "meter_delta_j": delta,
            "sum_request_j": attributed, "ratio": attributed / delta if delta else None,
            "j_per_token": attributed / tokens if tokens else None, "source": usages[0]["energy_source"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--modes", default="fp16,continuous_batching")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tag", default="")
    args, server_args = p.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    tmp = Path(tempfile.mkdtemp(prefix="modeswitch-energy-"))
    proc, url, _ = start_server(tmp, "--model", args.model, "--modes", args.modes, "--gate-report", "none",
                                *server_args)
    meter = open_meter()
    rows = []
    try:
        for mode in args.modes.split(","):
            for conc in (1, args.concurrency):
                row = block(url, meter, mode, args.requests, conc, args.max_tokens)
                rows.append(row)
                print(f"{mode:28s} batch {conc}: {row['sum_request_j']:.1f} J attributed of {row['meter_delta_j']:.1f} J "
                      f"({row['ratio']:.3f}), {row['j_per_token']:.3g} J/token ({row['source']})")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ok = all(r["ratio"] is not None and abs(r["ratio"] - 1) <= 0.05 for r in rows)
    print("PASS" if ok else "FAIL", "(per-request energy within 5 % of the meter in every block)")
    source = getattr(meter, "name", "server estimate")
    md = [f"# Energy attribution check: {args.model}, {source} ({'PASS' if ok else 'FAIL'})", "",
          "| mode | batch | requests | tokens | meter delta J | sum of requests J | ratio | J/token |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['batch']} | {r['requests']} | {r['tokens']} | {report.number(r['meter_delta_j'])} | "
           f"{report.number(r['sum_request_j'])} | {report.number(r['ratio'])} | {report.number(r['j_per_token'])} |"
           for r in rows]
    stem = report.save_results(ROOT / "benchmarks" / "results", f"energy_{Path(args.model).name}", args.tag,
                               {"date": datetime.now(timezone.utc).isoformat(), "model": args.model,
                                "meter": source, "pass": ok, "rows": rows}, "\n".join(md) + "\n")
    print(f"wrote {stem}.json and .md")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
