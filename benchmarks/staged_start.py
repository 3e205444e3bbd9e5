"""What a staged start's first engine serves while the other engines start: with and without yielding, or led
by the engine measured fastest against the policy list's first.

Each variant's server is started with the same flags and, from the moment it answers, one client sends greedy
32-token completions back to back (the worst case for yielding: the server never idles) until every mode is up,
then ``--after`` more. Reported: time to ready and to every mode up, and ms per output token while modes load
against after, per variant side by side. Prints a table, writes JSON + markdown to benchmarks/results/.

``--variants yield``: ``--yield-start-s 0`` (the later engines compete for the CPU from the start) against the
default (they start under SCHED_IDLE and yield to the requests served). ``--variants lead``, for a second start
(give ``--costs-file`` with an earlier run's measurements): the default policy, whose staged start leads with the
weights measured fastest here, against the same policy with ``order: listed``, which leads with the list's first
mode (the reference weights); once every mode is up that one keeps the list's order, so only the column while
loading compares the lead.

    .venv/bin/python benchmarks/staged_start.py [--variants yield|lead] [--after 10] [--tag T] [-- serve.py flags]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.resources import DEFAULT_POLICY  # noqa: E402
from modeswitch.serving.launcher import ROOT, launch_server, wait_stopped  # noqa: E402

PROMPT = "The Jargon File is a glossary of hacker slang. Write a long story about a hacker who " * 3


def variants(kind: str, tmp: Path) -> dict[str, list[str]]:
    """The extra serve.py flags of each variant compared."""
    if kind == "yield":
        return {"compete (--yield-start-s 0)": ["--yield-start-s", "0"], "yield (default)": []}
    listed = tmp / "listed.yaml"
    text = DEFAULT_POLICY.read_text()
    if "\norder: predicted\n" not in text:
        raise SystemExit(f"{DEFAULT_POLICY} does not order by prediction: nothing to compare")
    listed.write_text(text.replace("\norder: predicted\n", "\norder: listed\n"))
    return {"the list's first mode leads (order: listed)": ["--policy", str(listed)],
            "the weights measured fastest lead (default)": []}


def run(flags: list[str], after: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        server = launch_server(Path(tmp), "--model", "demo", *flags)
        try:
            server.wait_ready(wait_s=900, all_modes=False)
            ready_s, all_up_s, rows = time.monotonic() - t0, None, []
            while sum(r["loading"] == 0 for r in rows) < after:
                loading = requests.get(server.url + "/health", timeout=10).json().get("modes_loading", 0)
                if not loading and all_up_s is None:
                    all_up_s = time.monotonic() - t0
                sent = time.monotonic()
                body = requests.post(server.url + "/v1/completions", timeout=600, json={
                    "prompt": PROMPT, "max_tokens": 32, "temperature": 0}).json()
                rows.append({"t": round(sent - t0, 1), "loading": loading,
                             "ms_per_token": round(1000 * (time.monotonic() - sent)
                                                   / max(body["usage"]["completion_tokens"], 1), 1),
                             "mode": body["modeswitch"]["mode"]})
        finally:
            server.proc.terminate()
            wait_stopped(server.proc)

    def mean(sel: list[dict]) -> float | None:
        return round(sum(r["ms_per_token"] for r in sel) / len(sel), 1) if sel else None

    loading, done = [r for r in rows if r["loading"]], [r for r in rows if not r["loading"]]
    return {"ready_s": round(ready_s, 1), "all_up_s": round(all_up_s, 1), "requests_while_loading": len(loading),
            "modes_while_loading": sorted({r["mode"] for r in loading}),
            "ms_per_token_while_loading": mean(loading), "ms_per_token_after": mean(done), "requests": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", choices=("yield", "lead"), default="yield")
    ap.add_argument("--after", type=int, default=10, help="requests sent once every mode is up")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    flags = [a for a in args.server_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(flags + extra, args.after) for name, extra in variants(args.variants, Path(tmp)).items()}
    lines = ["| variant | ready s | every mode up s | requests while loading | modes while loading | "
             "ms/token while loading | ms/token after | while / after |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        ratio = (f"{r['ms_per_token_while_loading'] / r['ms_per_token_after']:.2f}x"
                 if r["ms_per_token_while_loading"] else "-")
        lines.append(f"| {name} | {r['ready_s']} | {r['all_up_s']} | {r['requests_while_loading']} | "
                     f"{', '.join(r['modes_while_loading'])} | {r['ms_per_token_while_loading']} | "
                     f"{r['ms_per_token_after']} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    save_results(args.out, "staged_start", args.tag, {"flags": flags, "variants": results},
                 f"# Serving during a staged start ({' '.join(['--model demo', *flags])}; {processor()})\n\nOne "
                 f"client, greedy "
                 f"32-token completions back to back from ready until every mode is up, then {args.after} more."
                 f"\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
