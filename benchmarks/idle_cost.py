"""What resident modes cost while nothing is asked of them: CPU time and memory of the idle server.

Starts the server (any serve.py flags), waits until it is ready and has been idle for ``--settle`` seconds,
then measures over ``--seconds`` the CPU time of the server process and each of its child processes (vLLM's
engine cores and workers) and their resident memory. Prints a table, writes JSON + markdown to
benchmarks/results/.

    .venv/bin/python benchmarks/idle_cost.py [--tag T] [-- serve.py flags, e.g. --backend vllm]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import save_results  # noqa: E402
from modeswitch.serving.launcher import ROOT, start_server  # noqa: E402


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_seconds(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    flags = [a for a in args.server_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        proc, url, _ = start_server(Path(tmp), *flags, wait_s=900)
        ready_s = round(time.perf_counter() - started, 1)
        try:
            time.sleep(args.settle)
            procs = tree(proc.pid)
            before = cpu_seconds(procs)
            time.sleep(args.seconds)
            after = cpu_seconds(procs)
            rows = []
            for p in procs:
                if p.pid not in before or p.pid not in after:
                    continue
                rows.append({"pid": p.pid, "name": p.name() if p.pid != proc.pid else "server",
                             "cpu_pct": round(100 * (after[p.pid] - before[p.pid]) / args.seconds, 2),
                             "rss_mib": round(p.memory_info().rss / 2**20, 1), "threads": p.num_threads()})
            modes = [m["name"] for m in requests.get(url + "/v1/modes", timeout=30).json()["modes"]
                     if m["status"] == "available"]
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    total_cpu = round(sum(r["cpu_pct"] for r in rows), 2)
    total_rss = round(sum(r["rss_mib"] for r in rows), 1)
    lines = ["| process | CPU % of one core (idle) | RSS MiB | threads |", "|---|---|---|---|"]
    lines += [f"| {r['name']} ({r['pid']}) | {r['cpu_pct']} | {r['rss_mib']} | {r['threads']} |" for r in rows]
    lines.append(f"| **total** ({len(modes)} modes: {', '.join(modes)}) | {total_cpu} | {total_rss} | |")
    lines.append(f"\nReady {ready_s} s after start.")
    table = "\n".join(lines)
    print(table)
    save_results(args.out, "idle_cost", args.tag,
                 {"flags": flags, "seconds": args.seconds, "processes": rows, "total_cpu_pct": total_cpu,
                  "total_rss_mib": total_rss, "ready_s": ready_s, "modes": modes},
                 f"# Idle cost of the resident modes ({' '.join(flags) or 'defaults'})\n\n"
                 f"CPU over {args.seconds:.0f} s after {args.settle:.0f} s idle.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
