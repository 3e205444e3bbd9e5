"""Where a vLLM engine's restart spends its time: one engine of the demo (``--mode``, default fp16) is served, its
engine-core process gets SIGKILL, and the time from the kill is read at each phase: the supervisor seeing the death
(the mode leaves the pool), the replacement's phases as vLLM's own log lines in its engine-core process time them
(process up, weights loaded, KV cache and warm-up), the mode back in the pool, and its first answer.

vLLM's engine processes log to this process's stdout and stderr, which the script sends to ``--log`` (vLLM at INFO)
and reads back at the end; its own lines go to the terminal.

With ``--load N``, N client threads keep requests on the mode throughout (each submits the next once its last
has ended, while the mode is up; half a second after a failure), and every request's outcome is counted: per kill,
the requests in flight when it died and how each ended (``done``, an ``error`` event, or ``unanswered`` after
``--timeout``); ``--every`` spaces the kills (seconds from one kill to the next), so a run shows whether an engine
killed again and again keeps coming back.

    .venv/bin/python benchmarks/restart_phases.py [--mode fp16] [--decode eager|auto] [--kills 1]
                                                  [--load 0] [--every 0] [--timeout 120]
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import sys
import threading
import time
from collections import Counter
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
    ap.add_argument("--load", type=int, default=0, help="client threads keeping requests on the mode")
    ap.add_argument("--every", type=float, default=0.0, help="seconds from one kill to the next")
    ap.add_argument("--timeout", type=float, default=120.0, help="a request unanswered this long counts as such")
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
    from modeswitch.engines.base import GenRequest
    from modeswitch.sampling_params import SamplingParams
    from modeswitch.modes import load_modes
    from modeswitch.serving.registry import ModeRegistry
    from modeswitch.weights.presets import PRESETS

    load = LoadConfig(backend="vllm", device="cpu", staged=False, decode=args.decode)
    registry = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == args.mode], load)
    started = time.time()
    registry.load(progress=lambda line: print(line, file=console))
    first_start_s = time.time() - started
    state = registry.modes[args.mode]

    def ask(max_tokens: int) -> str:
        """One request to the mode's engine: how it ended."""
        req = GenRequest(prompt_ids=[1, 504, 3458, 282], params=SamplingParams(max_tokens=max_tokens))
        try:
            state.engine.submit(req)
        except Exception as exc:  # a full queue, or an engine that went down as the request came
            return f"refused ({type(exc).__name__})"
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            try:
                event = req.events.get(timeout=max(deadline - time.time(), 0.01))
            except queue.Empty:
                break
            if event.kind != "tokens":
                return event.kind
        return "unanswered"

    def answer_s() -> float:
        began = time.time()
        outcome = ask(8)
        assert outcome == "done", outcome
        return time.time() - began

    loaded: list[tuple[float, float, str]] = []  # (submitted, ended, outcome) of every loaded request
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            if not state.available:  # the server's gate keeps requests off a mode whose engine is down
                time.sleep(0.05)
                continue
            began = time.time()
            outcome = ask(32)
            loaded.append((began, time.time(), outcome))
            if outcome != "done":  # between the death and the supervisor's seeing it, the engine fails at once:
                time.sleep(0.5)  # a client backs off rather than counting that window a thousand times

    answer_s()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(args.load)]
    for thread in clients:
        thread.start()
    kills = []
    try:
        for k in range(args.kills):
            if k and args.every:
                time.sleep(max(kills[-1]["killed_at"] + args.every - time.time(), 0.0))
            pid = state.engine.runner.pids[0]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            out: dict = {"killed_at": killed}
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
        stop.set()
        for thread in clients:
            thread.join(args.timeout + 5)
        for out in kills:  # the requests each kill caught in flight, by how they ended
            out["in_flight_at_kill"] = dict(Counter(o for began, ended, o in loaded
                                                    if began <= out["killed_at"] < ended))
    finally:
        stop.set()
        registry.close()
    under_load = {"clients": args.load, "requests": dict(Counter(o for *_, o in loaded)),
            "still_in_flight": sum(thread.is_alive() for thread in clients)}
    phase_rows = [f"| {name} | {p['at_s']} | {p['own_s'] if p['own_s'] is not None else ''} |"
                  for name, p in kills[0]["vllm_phases"].items()]
    table = "\n".join([
        "| from the kill | s | vLLM's own figure (s) |", "|---|---|---|",
        f"| death seen, mode out of the pool | {kills[0]['death_seen_s']} | |", *phase_rows,
        f"| mode serving again | {kills[0]['serving_again_s']} | |",
        f"| first answer | {kills[0]['first_answer_s']} | |"])
    if args.load:
        table += "\n\n" + "\n".join([
            f"Under load ({args.load} clients, a kill every {args.every:g} s):", "",
            "| kill | death seen (s) | serving again (s) | first answer (s) | requests in flight at the kill |",
            "|---|---|---|---|---|",
            *[f"| {i + 1} | {k['death_seen_s']} | {k['serving_again_s']} | {k['first_answer_s']} | "
              f"{k['in_flight_at_kill'] or 'none'} |" for i, k in enumerate(kills)],
            "", f"Every request: {under_load['requests']}; client threads still waiting at the end: "
                f"{under_load['still_in_flight']}."])
    print(table, file=console)
    stem = save_results(args.out, "restart_phases_demo", args.tag or f"{args.mode}-{args.decode}",
                        {"processor": processor(), "args": vars(args), "first_start_s": round(first_start_s, 1),
                         "kills": kills, "load": under_load},
                        f"# Restart phases ({processor()}, mode {args.mode}, decode {args.decode}; first start "
                        f"{first_start_s:.0f} s)\n\n{table}\n")
    print(f"wrote {stem}.json/.md", file=console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
