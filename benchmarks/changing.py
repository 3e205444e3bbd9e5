"""A changing workload against every static configuration of vLLM's own server, and ModeSwitch's default.

One trace of four phases (``modeswitch.bench.phases``): a lull at 1 client where half of the requests copy
their prompt (a list, code, a paragraph) and half write prose; a burst of prose continuations at 12 clients;
questions about one shared document at 4 clients; a lull again. All greedy, streamed over HTTP, the same
token ids to every server. Per server and phase: mean and p90 end-to-end latency, output tok/s over the
phase's wall time, the tokens generated, the cores its front ends (HTTP, tokenizing, routing, engine clients) and
its engines kept busy (CPU seconds over wall seconds), and (ModeSwitch) the modes that served; then, for a ModeSwitch
server whose policy orders by the cost model, what its requests took over what their decision predicted, per phase
and mode (``report.prediction_accuracy``).

Servers run one at a time (nothing else running; ModeSwitch's engines and three vLLM servers do not fit in
memory together here): start, one warm-up trace (other prompts, not counted: first-shape compilation, and
what a server that has run a while has learned), then ``--repeats`` traces with other prompts each. The
whole sequence runs ``--rounds`` times, so drift over the run shows as spread instead of as a ratio.
``--interleave`` (for a few rows that fit in memory together) starts and warms up every row first, then runs
their traces in turn, trace by trace, each row's processes stopped (SIGSTOP) while another is measured: on a
machine whose speed drifts over minutes, the rows' traces of one index then meet the same machine.

Static configurations of vLLM's server, in the reference dtype: plain; n-gram speculation (k=5, as vLLM's
docs show it); n-gram with vLLM's batch-size schedule (``num_speculative_tokens_per_batch_size``: fewer draft
tokens as the batch grows); n-gram with vLLM's OpenMP threads on every core; and on a machine of 2+ cores one
n-gram server per core, each computing on its own, the requests sent to them in turn (round robin: what a user
with one vLLM flag and a load balancer gets from every core). ``--w8a8-peer`` adds vLLM's server on ModeSwitch's
W8A8 checkpoint with n-gram speculation (alone and one per core): the static configuration of ModeSwitch's int8
modes, to tell the controller's part from the weights'; on a CPU where ModeSwitch's int8 engines compute on FBGEMM
(oneDNN lacking an int8 kernel: AVX2), also one per core on those same kernels (the plugin's ``FBGEMM_ENV``), to
tell the controller's part from the kernel's.

``--code LABEL=DIR`` runs the ModeSwitch row of that label from another checkout (its serve.py and package), so two
versions of the code run in one sequence: on a machine whose speed drifts by more than a change's effect, only
rows of one run compare.

``--pinned`` measures the controller's own worth: beside each of a ModeSwitch server's own traces, the same
server (started once, its engines warm and measured) runs the same trace with every request pinned to one mode,
for every mode it has available (the order of these traces rotating from one trace index to the next, so none
always runs first), its row labelled ``<server> pinned <mode>``; the table then gives the best
pinned mode's mean over the adaptive one's, per phase. Each pinned trace opens every prompt with a marker of its
own (``phases``' salt): the same text, which the prefix caches the adaptive trace filled do not hold. ``--pin MODE``
(repeatable) pins only to the modes named. ``--only LABEL`` (repeatable) runs only the rows of those labels.

    .venv/bin/python benchmarks/changing.py [--model demo] [--repeats 2] [--rounds 1] [--w8a8-peer] [--pinned]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.client import pct, send  # noqa: E402
from modeswitch.bench.phases import phases  # noqa: E402
from modeswitch.bench.report import accuracy_table, prediction_accuracy, processor, save_results  # noqa: E402
from modeswitch.device import machine  # noqa: E402
from modeswitch.engines.vllm.int8_fbgemm import onednn_lacks_int8_kernel  # noqa: E402
from modeswitch.engines.vllm.plugin import FBGEMM_ENV  # noqa: E402
from modeswitch.bench.servers import REFERENCE_DTYPE, Server  # noqa: E402
from modeswitch.bench.workloads import rotated, rotated_rounds  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
#: vLLM's dynamic speculation: k by the batch size (inclusive ranges)
SCHEDULE = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 6, 3], [7, 256, 1]]}
WARMUP_RUN = 1000  # the warm-up trace's prompts: far from the measured runs' text


def every_core() -> str:
    """vLLM's CPU binding of a worker to every core of this machine (by default it leaves one to its scheduler)."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def static_servers(w8a8_peer: bool, checkpoint: str | None) -> list[Server]:
    servers = [Server(f"vLLM {REFERENCE_DTYPE}"),
               Server(f"vLLM {REFERENCE_DTYPE} + n-gram k=5", vllm_flags=["--speculative-config", json.dumps(NGRAM)]),
               Server(f"vLLM {REFERENCE_DTYPE} + n-gram by batch size",
                      vllm_flags=["--speculative-config", json.dumps(SCHEDULE)]),
               Server(f"vLLM {REFERENCE_DTYPE} + n-gram k=5, OMP on every core", env={"VLLM_CPU_OMP_THREADS_BIND": every_core()},
                      vllm_flags=["--speculative-config", json.dumps(NGRAM)])]
    if len(os.sched_getaffinity(0)) > 1:
        servers.append(Server(f"vLLM {REFERENCE_DTYPE} + n-gram k=5, one per core, round robin", per_core=True,
                              vllm_flags=["--speculative-config", json.dumps(NGRAM)]))
    if w8a8_peer:
        servers.append(Server("vLLM W8A8 + n-gram k=5", checkpoint=checkpoint,
                              vllm_flags=["--speculative-config", json.dumps(NGRAM)]))
        if len(os.sched_getaffinity(0)) > 1:
            servers.append(Server("vLLM W8A8 + n-gram k=5, one per core, round robin", checkpoint=checkpoint,
                                  per_core=True, vllm_flags=["--speculative-config", json.dumps(NGRAM)]))
        if len(os.sched_getaffinity(0)) > 1 and onednn_lacks_int8_kernel():  # ModeSwitch's int8 kernel here
            servers.append(Server("vLLM W8A8 on FBGEMM + n-gram k=5, one per core, round robin", checkpoint=checkpoint,
                                  per_core=True, env={FBGEMM_ENV: "1"},
                                  vllm_flags=["--speculative-config", json.dumps(NGRAM)]))
    return servers


def run_trace(server: Server, tokenizer, run: int, mode: str | None = None, salt: int = 0) -> list[dict]:
    """Every phase of run ``run`` in order (its prompts opened by ``salt``'s marker, see ``phases``), each at its own
    concurrency (every request pinned to ``mode`` if given); records tagged with phase, wall time and the CPU
    seconds the server's front ends and engines used in the phase."""
    records = []
    for phase in phases(tokenizer, run, salt=salt):
        t0, cpu0 = time.perf_counter(), server.cpu_seconds()
        got = send(server.urls, list(phase.slots), mode=mode, concurrency=phase.concurrency)
        wall = time.perf_counter() - t0
        front, engines = (after - before for before, after in zip(cpu0, server.cpu_seconds()))
        for r in got:
            r.update(phase=phase.name, phase_wall_s=wall, phase_front_cpu_s=front, phase_engine_cpu_s=engines, run=run)
        failed = [r for r in got if not r["ok"]]
        if failed:
            raise RuntimeError(f"{server.label}: {len(failed)} of {len(got)} requests failed in {phase.name}: "
                               f"{failed[0]['error']}")
        records += got
    return records


def available_modes(url: str) -> list[str]:
    """The modes a ModeSwitch server has available and its quality gate passes (what a pinned request may use),
    in its /v1/modes order."""
    import requests

    return [m["name"] for m in requests.get(url + "/v1/modes", timeout=30).json()["modes"]
            if m["status"] == "available" and m.get("quality_gate", "pass") == "pass"]


def summarize(records: list[dict]) -> dict:
    """Latency, throughput and mode mix of one server's records in one phase (or all), over every run."""
    lat = [r["latency_s"] for r in records]
    by_run: dict[int, list[dict]] = {}
    for r in records:
        by_run.setdefault(r["run"], []).append(r)
    run_means = [statistics.fmean(r["latency_s"] for r in rs) for rs in by_run.values()]
    # each phase of each run once: its wall seconds, and the CPU seconds of the server's front ends and engines
    phase_runs = {(r["run"], r["phase"]): (r["phase_wall_s"], r["phase_front_cpu_s"], r["phase_engine_cpu_s"])
                  for r in records}
    wall, front, engines = (sum(column) for column in zip(*phase_runs.values()))
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "mean_s": statistics.fmean(lat), "p90_s": pct(lat, 0.9),
            "run_means_s": run_means, "tokens": tokens, "out_tok_s": tokens / wall,
            # the cores its front ends (HTTP, tokenizing, routing, the engine clients) and engines kept busy
            "front_cores": front / wall, "engine_cores": engines / wall,
            "modes": dict(Counter(r["mode"] for r in records if r.get("mode")))}


class Sequence:
    """One round: every server started afresh, warmed up by a trace, then measured ``--repeats`` times (each
    measured trace followed, with ``--pinned``, by one pinned to each of its modes)."""

    def __init__(self, args: argparse.Namespace, servers: list[Server], model_dir: str, tokenizer, log_dir: Path,
                 rnd: int, records: dict[str, list[dict]], failed: dict[str, str]) -> None:
        self.args, self.servers, self.model_dir, self.tokenizer = args, servers, model_dir, tokenizer
        self.log_dir, self.rnd = log_dir, rnd
        #: every round's records by row, and the pinned rows whose mode could not serve a whole trace alone, and why
        self.records, self.failed = records, failed
        self.pinned: dict[str, list[str]] = {}  # per server, the modes its pinned traces use

    def one_at_a_time(self) -> None:
        """Each server alone: start, warm up, its traces, stop; then the next."""
        for server in self.servers:
            try:
                self.start(server)
                for i in range(self.args.repeats):
                    self.measure(server, i)
            finally:
                server.stop()

    def interleaved(self) -> None:
        """Every server started (and warmed up) first, each paused while it is not measured; then trace by trace
        every server in turn, the order rotating, so that a drifting machine meets every server within minutes of
        each other and the ratios of one trace compare."""
        try:
            for server in self.servers:
                self.start(server)
                server.pause()
            for i, server in rotated_rounds(self.servers, self.args.repeats):
                server.resume()
                self.measure(server, i)
                server.pause()
        finally:
            for server in self.servers:
                server.stop()

    def start(self, server: Server) -> None:
        server.proc, server.url = None, ""  # a fresh start each round
        server.start(self.model_dir, self.args.model, self.log_dir)
        run_trace(server, self.tokenizer, WARMUP_RUN + self.rnd)
        pinned = available_modes(server.url) if self.args.pinned and server.flags is not None else []
        self.pinned[server.label] = [m for m in pinned if not self.args.pin or m in self.args.pin]

    def measure(self, server: Server, i: int) -> None:
        """Its ``i``-th trace of the round and (with ``--pinned``) one of the same text pinned to each mode, their
        order rotated by ``i``: drift hits every row alike, and no row always runs first after the server resumes
        or right after another row's trace."""
        args = self.args
        pinned = self.pinned[server.label] if i < args.pinned_repeats else []
        for j, mode in rotated(list(enumerate([None, *pinned])), i):
            label = server.label if mode is None else f"{server.label} pinned {mode}"
            if label in self.failed:
                continue
            try:
                # the adaptive trace's text, behind an opening of its own (its prompts are in the prefix caches)
                got = run_trace(server, self.tokenizer, self.rnd * args.repeats + i, mode, salt=j)
            except RuntimeError as exc:  # one mode alone may not take a phase's load: a row of its own
                if mode is None:
                    raise
                print(f"  round {self.rnd}, {label}, run {i}: {exc}", flush=True)
                self.failed[label] = str(exc)
                self.records.pop(label, None)
                continue
            self.records.setdefault(label, []).extend(got)
            mean = statistics.fmean(r["latency_s"] for r in got)
            print(f"  round {self.rnd}, {label}, run {i}: mean {mean:.3f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--modeswitch", action="append", default=None,
                    help="'label=serve.py flags' for one ModeSwitch server (repeatable; default: make serve's)")
    ap.add_argument("--code", action="append", default=[],
                    help="'label=DIR': the ModeSwitch server of that label runs the checkout in DIR (repeatable)")
    ap.add_argument("--repeats", type=int, default=2, help="measured traces per server start, other prompts each")
    ap.add_argument("--rounds", type=int, default=1, help="times the whole sequence of servers runs")
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first and run their traces in turn, each paused while not measured")
    ap.add_argument("--w8a8-peer", action="store_true", help="add vLLM's server on the W8A8 checkpoint + n-gram")
    ap.add_argument("--only", action="append", default=None, help="a server's label to run (repeatable; default: all)")
    ap.add_argument("--pinned", action="store_true", help="also run each ModeSwitch server pinned to each of its modes")
    ap.add_argument("--pinned-repeats", type=int, default=1, help="of the repeats, how many also run every pinned mode")
    ap.add_argument("--pin", action="append", default=None, help="with --pinned: only this mode (repeatable)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--logs", help="keep the servers' logs in this folder (default: a temporary one, removed)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from modeswitch.weights.presets import local_or_hub, resolve_preset

    preset = resolve_preset(args.model)
    model_dir = local_or_hub(preset.fp16, "fp16 weights")
    checkpoint = local_or_hub(preset.w8a8, "W8A8 weights") if args.w8a8_peer else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    servers = static_servers(args.w8a8_peer, checkpoint)
    code = dict(c.split("=", 1) for c in args.code)
    servers += [Server(label, flags, code=code.get(label)) for label, flags in
                (s.split("=", 1) for s in args.modeswitch or ["ModeSwitch default (make serve)="])]
    if args.only:
        servers = [s for s in servers if s.label in args.only]
    records: dict[str, list[dict]] = {s.label: [] for s in servers}
    served: dict[str, Counter] = {s.label: Counter() for s in servers}
    failed: dict[str, str] = {}  # pinned rows whose mode could not serve a whole trace alone, and why
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.logs or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for rnd in range(args.rounds):
            sequence = Sequence(args, servers, model_dir, tokenizer, Path(tmp), rnd, records, failed)
            if args.interleave:
                sequence.interleaved()
            else:
                sequence.one_at_a_time()
            for server in servers:
                served[server.label].update(server.served)
    summary = summaries(records)
    table = report(summary) + "".join(f"\n\n{label}: not in the table, it failed a trace: {why}"
                                      for label, why in failed.items())
    accuracy = {label: a for label, rs in records.items() if " pinned " not in label and (a := prediction_accuracy(rs))}
    if accuracy:
        table += ("\n\nWhat the requests took over what their decision predicted for the mode chosen (medians):\n\n"
                  + accuracy_table(accuracy))
    print(table)
    how = "their traces in turn, the others paused" if args.interleave else "one server at a time"
    stem = save_results(args.out, f"changing_{Path(args.model).name}", args.tag,
                        {"model": args.model, "processor": processor(), "cpu_flags": machine(), "repeats": args.repeats,
                         "rounds": args.rounds, "interleaved": args.interleave, "summary": summary,
                         "decision_us": decision_us(records), "prediction_accuracy": accuracy,
                         "pinned_failed": failed,
                         "requests_by_mode": {k: dict(v) for k, v in served.items()},
                         "records": {label: [compact(r) for r in rs] for label, rs in records.items()}},
                        f"# A changing workload ({args.model}, {processor()})\n\n{args.rounds} round(s) x {args.repeats} "
                        f"trace(s) per server, {how}.\n\n{table}\n")
    print(f"wrote {stem}.json/.md")
    return 0


PHASES = ("lull", "burst", "shared_prefix", "lull2", "overall")
#: what a saved record keeps of the features a ModeSwitch server decided on
KEPT_FEATURES = ("prompt_tokens", "queue_depth", "prompt_repeat", "draft_tokens_per_step", "drafts_per_step",
                 "speculation_gain",
                 "in_flight_by_mode", "prefilling_by_mode", "decode_overlap_by_mode")


def decision_us(records: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per ModeSwitch row that decided (not pinned), the controller's decision cost (the deciding thread's CPU
    time) and its wall time, and the wall time of the request's features before it: p50 and p90 in us."""
    out = {}
    for label, rs in records.items():
        if " pinned " in label:
            continue
        for name, key in (("cpu", "decision_us"), ("wall", "decision_wall_us"), ("features", "features_us")):
            us = sorted(r[key] for r in rs if r.get(key) is not None)
            if us:
                out.setdefault(label, {"n": len(us)}).update(
                    {f"{name}_p50": statistics.median(us), f"{name}_p90": pct(us, 0.9)})
    return out


def compact(record: dict) -> dict:
    """A record as saved: the features that explain a drafting decision, not every one."""
    features = record.get("features") or {}
    return {**record, "features": {k: features[k] for k in KEPT_FEATURES if k in features} or None}


def summaries(records: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """Per server (that ran) and phase, and overall: :func:`summarize`."""
    return {label: {p: summarize([r for r in rs if p == "overall" or r["phase"] == p]) for p in PHASES}
            for label, rs in records.items() if rs}


def paired(theirs: list[float], own: list[float]) -> tuple[float, float]:
    """Two rows' means over the runs both have, from their run means (a pinned row runs only the first
    ``--pinned-repeats`` of the repeats, each beside the adaptive run of the same index): like with like."""
    n = min(len(theirs), len(own))
    return statistics.fmean(theirs[:n]), statistics.fmean(own[:n])


def report(summary: dict[str, dict[str, dict]]) -> str:
    """The table: per phase and overall, each server's mean (range of run means) / p90 / tok/s; then per ModeSwitch
    server the ratio of the best static configuration's mean to its own over the runs both have, in every phase (the
    best of each phase) and per run (the same prompts), against vLLM's configurations in the reference dtype (the
    target) and against every vLLM row (the W8A8 peer included: what the weights alone give)."""
    lines = ["| server | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for label, phases_ in summary.items():
        cells = []
        for p in PHASES:
            s = phases_[p]
            cells.append(f"{s['mean_s']:.3f} s ({min(s['run_means_s']):.3f}-{max(s['run_means_s']):.3f}), "
                         f"p90 {s['p90_s']:.2f}, {s['out_tok_s']:.0f} tok/s, {s['tokens']} tok, "
                         f"CPU {s['front_cores']:.2f} front + {s['engine_cores']:.2f} engines")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    reference = [label for label in summary if label.startswith(f"vLLM {REFERENCE_DTYPE}")]
    every = [label for label in summary if label.startswith("vLLM")]
    for label in (l for l in summary if l not in every and " pinned " not in l):
        pinned = [l for l in summary if l.startswith(f"{label} pinned ")]
        for name, static in (("reference-dtype vLLM", reference), ("any vLLM row", every), ("pinned mode", pinned)):
            if not static:
                continue
            cells = []
            for p in PHASES:
                own = summary[label][p]["run_means_s"]
                pairs = {l: paired(summary[l][p]["run_means_s"], own) for l in static}
                best = min(static, key=lambda l: pairs[l][0])
                ratio = pairs[best][0] / pairs[best][1]
                # run by run, over the runs both sides have
                per_run = [min(means) / run for i, run in enumerate(own)
                           if (means := [summary[l][p]["run_means_s"][i] for l in static
                                         if i < len(summary[l][p]["run_means_s"])])]
                cells.append(f"**{ratio:.2f}x** (runs {', '.join(f'{r:.2f}' for r in per_run)}) vs {best}")
            lines.append(f"| {label}: best {name} / it | " + " | ".join(cells) + " |")
        mix = "; ".join(f"{p}: {summary[label][p]['modes']}" for p in PHASES[:-1])
        lines.append(f"| {label}: modes | {mix} |" + " |" * (len(PHASES) - 1))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
