"""Where a vLLM engine's restart spends its time: one engine of the demo (``--mode``, default fp16) is served, its
engine-core process gets SIGKILL, and the time from the kill is read at each phase: the supervisor seeing the death
(the mode leaves the pool), the replacement's phases as vLLM's own log lines in its engine-core process time them
(process up, weights loaded, KV cache and warm-up), the mode back in the pool, and its first answer.

vLLM's engine processes log to this process's stdout and stderr, which the script sends to ``--log`` (vLLM at INFO)
and reads back at the end; its own lines go to the terminal.

    .venv/bin/python benchmarks/restart_phases.py [--mode fp16] [--decode eager|auto] [--kills 1]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

#: vLLM's log lines that mark a phase of an engine's start (their own seconds, where they state them)
PHASES = {
    "engine core process up": re.compile(r"Initializing a V1 LLM engine"),
    "weights loaded": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "KV cache, warm-up (and compile) done": re.compile(r"init engine \(profile, create kv cache, warmup model\) took "
                                                       r"([\d.]+) s"),
}
#: vLLM's log prefix: level, month-day and time
STAMP = re.compile(r"(?:INFO|WARNING|DEBUG)\s+(\d\d-\d\d \d\d:\d\d:\d\d)")


def phases_in(log: Path, since: float) -> dict[str, dict]:
    """The first line of each phase logged after ``since`` (epoch seconds), with its time from ``since`` (vLLM
    stamps whole seconds) and the seconds the line itself states."""
    year = datetime.now().year
    found: dict[str, dict] = {}
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.search(line)
        if not stamp:
            continue
        at = datetime.strptime(f"{year}-{stamp.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp()
        if at < int(since):
            continue
        for name, pattern in PHASES.items():
            if name not in found and (match := pattern.search(line)):
                found[name] = {"at_s": round(at - since, 1),
                               "own_s": float(match.group(1)) if match.groups() else None}
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="fp16")
    ap.add_argument("--decode", default="eager", choices=("auto", "compiled", "eager"))
    ap.add_argument("--kills", type=int, default=1)
    ap.add_argument("--log", default="/tmp/restart_phases.log")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    log = Path(args.log)
    console = os.fdopen(os.dup(1), "w", buffering=1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)  # the engine processes inherit both
    os.dup2(fd, 2)
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO"

    from modeswitch.config import LoadConfig
    from modeswitch.engines.base import GenRequest, SamplingParams
    from modeswitch.modes import load_modes
    from modeswitch.serving.registry import ModeRegistry
    from modeswitch.weights.presets import PRESETS

    load = LoadConfig(backend="vllm", device="cpu", staged=False, decode=args.decode)
    registry = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == args.mode], load)
    started = time.time()
    registry.load(progress=lambda line: print(line, file=console))
    first_start_s = time.time() - started
    state = registry.modes[args.mode]

    def answer_s() -> float:
        req = GenRequest(prompt_ids=[1, 504, 3458, 282], params=SamplingParams(max_tokens=8))
        began = time.time()
        state.engine.submit(req)
        while (event := req.events.get(timeout=120)).kind == "tokens":
            pass
        assert event.kind == "done", event.info
        return time.time() - began

    answer_s()
    kills = []
    try:
        for _ in range(args.kills):
            pid = state.engine.runner.pids[0]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            out: dict = {}
            while state.available:  # the supervisor has not seen the death yet
                time.sleep(0.02)
            out["death_seen_s"] = round(time.time() - killed, 2)
            while not state.available:
                time.sleep(0.02)
            out["serving_again_s"] = round(time.time() - killed, 1)
            out["first_answer_s"] = round(out["serving_again_s"] + answer_s(), 1)
            out["vllm_phases"] = phases_in(log, killed)
            kills.append(out)
            print(out, file=console)
    finally:
        registry.close()
    phase_rows = [f"| {name} | {p['at_s']} | {p['own_s'] if p['own_s'] is not None else ''} |"
                  for name, p in kills[0]["vllm_phases"].items()]
    table = "\n".join([
        "| from the kill | s | vLLM's own figure (s) |", "|---|---|---|",
        f"| death seen, mode out of the pool | {kills[0]['death_seen_s']} | |", *phase_rows,
        f"| mode serving again | {kills[0]['serving_again_s']} | |",
        f"| first answer | {kills[0]['first_answer_s']} | |"])
    print(table, file=console)
    stem = save_results(args.out, "restart_phases_demo", args.tag or f"{args.mode}-{args.decode}",
                        {"processor": processor(), "args": vars(args), "first_start_s": round(first_start_s, 1),
                         "kills": kills},
                        f"# Restart phases ({processor()}, mode {args.mode}, decode {args.decode}; first start "
                        f"{first_start_s:.0f} s)\n\n{table}\n")
    print(f"wrote {stem}.json/.md", file=console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
