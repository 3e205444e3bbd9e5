"""ModeSwitch against vLLM's own OpenAI server, driven by vLLM's own benchmark client, on one machine.

Each server is started alone (nothing else running), then ``vllm bench serve`` sends the same workloads to
it: ``random`` (256 -> 32 tokens) and ``prefix_repetition`` (2 prefixes of 256 tokens + 32-token suffixes ->
32 tokens), 16 prompts at 4 concurrent clients (``--prompts``, ``--concurrency``), greedy, ignore-eos. The table gives output tokens/s and
median TTFT per server and workload, with each one's ratio to vLLM's server from the same run; JSON with the
client's full results lands in benchmarks/results/. ``--repeats N`` sends each workload N times to the same
server, each time with other prompts (seed 0..N-1: nothing is in the prefix cache from the time before), and
reports the median and the range: one run of 16 short prompts moves by 5-10 %. ``--interleave`` starts every
server first and runs the repeats in rounds over all of them, each server's processes stopped while another
runs (an idle vLLM CPU engine spins on its core): on a machine whose speed drifts (a shared VM here
gave vLLM's server 38.6 and 29.2 out tok/s on the same prompts half an hour apart) servers run one after
another compare different machines. For a ModeSwitch server the
JSON also keeps how many requests each mode served (``/v1/modes``), over all its runs. Each row also gives the
CPU time per output token of the server's own process (HTTP, tokenizing, the engine client) and of its engine
processes: a front end that takes CPU from the engines on a small machine shows there.

    .venv/bin/python benchmarks/vs_vllm.py [--model demo] [--modeswitch "label=serve.py flags" ...]
                                           [--vllm "label=ENV=VALUE ..." ...] [--repeats N]

Defaults compare vLLM's server in the reference dtype ModeSwitch runs (the machine's native 16-bit type: bf16
on CPUs with AVX512-BF16 or AMX, fp32 without; the first ``--vllm`` row is the reference of every ratio, further
rows start it with other environment settings or flags) with ``make serve``'s default (every reference
mode on vLLM engines, the batch-first policy, the shipped quality gate report enforced), with the same modes
under the reference design's paper policy, and with one vLLM engine serving fp16 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.bench.servers import CLI, REFERENCE_DTYPE, Server, vllm_row  # noqa: E402
from modeswitch.bench.workloads import rotated_rounds  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                          "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-output-len", "32"],
}
DEFAULT_MODESWITCH = [
    "make serve default=",
    "all modes on vLLM, paper policy=--backend vllm --policy policies/paper.yaml",
    "vLLM, fp16 alone=--backend vllm --modes fp16 --policy policies/fp16.yaml",
]


def bench(url: str, name: str, tokenizer: str, workload: str, out: Path, seed: int = 0, prompts: int = 16,
          concurrency: int = 4) -> dict:
    """One ``vllm bench serve`` run (``seed`` picks the prompts); the client's own result JSON."""
    cmd = [sys.executable, CLI, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", name, "--tokenizer", tokenizer, *WORKLOADS[workload],
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--temperature", "0", "--seed", str(seed), "--save-result",
           "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="ModeSwitch preset or path (vLLM's server gets its fp16 weights)")
    ap.add_argument("--modeswitch", action="append", default=None,
                    help="'label=serve.py flags' for one ModeSwitch server (repeatable; default: three)")
    ap.add_argument("--vllm", action="append", default=None,
                    help="'label=ENV=VALUE ... --flag ...' for one vLLM server: environment, then `vllm serve` flags "
                         "(repeatable; default: one, in the reference dtype)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=1, help="runs per workload and server, other prompts each (median)")
    ap.add_argument("--interleave", action="store_true",
                    help="start every server first, then run the repeats in rounds over all of them (rotated), "
                         "each paused while not measured: a machine whose speed drifts over the run moves every row "
                         "alike (the memory of all of them at once)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts a run")
    ap.add_argument("--concurrency", type=int, default=4, help="the client's concurrent requests")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from modeswitch.weights.presets import local_or_hub, resolve_preset

    model_dir = local_or_hub(resolve_preset(args.model).fp16, "fp16 weights")
    workloads = args.workloads.split(",")
    runs: list[dict] = []
    default_vllm = f"vLLM's own server, {REFERENCE_DTYPE}="
    servers = [Server(label, None, env, flags) for label, env, flags in map(vllm_row, args.vllm or [default_vllm])]
    servers += [Server(*s.split("=", 1)) for s in args.modeswitch or DEFAULT_MODESWITCH]
    repeats = args.repeats
    # (server, seed) in the order run: each server's repeats in a row, or rounds over every server, rotated
    order = ([(s, seed) for seed, s in rotated_rounds(servers, repeats)] if args.interleave
             else [(s, seed) for s in servers for seed in range(repeats)])
    results: dict[tuple[str, str], list[dict]] = {(s.label, w): [] for s in servers for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            for server in servers if args.interleave else ():  # all up before the first run, paused till its turn
                server.start(model_dir, args.model, tmp)
                server.pause()
            for server, seed in order:
                server.start(model_dir, args.model, tmp)
                if server.paused:
                    server.resume()
                for workload in workloads:
                    before = server.cpu_seconds()
                    r = bench(server.url, args.model, model_dir, workload, tmp / f"{servers.index(server)}-{workload}-{seed}.json",
                              seed, args.prompts, args.concurrency)
                    r["front_cpu_s"], r["engine_cpu_s"] = (b - a for a, b in zip(before, server.cpu_seconds()))
                    results[(server.label, workload)].append(r)
                    print(f"  {server.label}, {workload}, seed {seed}: {r['output_throughput']:.1f} out tok/s, "
                          f"TTFT p50 {r['median_ttft_ms']:.0f} ms, CPU front {r['front_cpu_s']:.1f} s, "
                          f"engines {r['engine_cpu_s']:.1f} s", flush=True)
                if not args.interleave and seed == repeats - 1:
                    server.stop()
                elif args.interleave:
                    server.pause()
        finally:
            for server in servers:
                server.stop()
    for server in servers:
        for workload in workloads:
            client = results[(server.label, workload)]
            tok_s = [r["output_throughput"] for r in client]
            runs.append({"server": server.label, "flags": server.flags,
                         "vllm": None if server.flags is not None else {"env": server.env, "flags": server.vllm_flags},
                         "workload": workload, "start_s": round(server.start_s, 1),
                         "loaded_s": round(server.loaded_s or server.start_s, 1),
                         "output_tok_s": statistics.median(tok_s), "output_tok_s_range": [min(tok_s), max(tok_s)],
                         "ttft_p50_ms": statistics.median(r["median_ttft_ms"] for r in client),
                         "tpot_p50_ms": statistics.median(r["median_tpot_ms"] for r in client),
                         # CPU per output token: the server's own process, and its engine processes
                         "front_cpu_ms_per_token": statistics.median(
                             1000 * r["front_cpu_s"] / max(r["total_output_tokens"], 1) for r in client),
                         "engine_cpu_ms_per_token": statistics.median(
                             1000 * r["engine_cpu_s"] / max(r["total_output_tokens"], 1) for r in client),
                         "completed": sum(r["completed"] for r in client), "client": client,
                         **({"requests_by_mode": server.served} if server.flags is not None else {})})
    ref = {}
    for r in runs:  # the first vLLM server is the reference
        if r["flags"] is None:
            ref.setdefault(r["workload"], r)
    lines = ["| server | workload | out tok/s | range | vs vLLM | TTFT p50 ms | vs vLLM | TPOT p50 ms | CPU ms/token: front / engines | ready s | all modes s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        base = ref[r["workload"]]
        r["tok_s_ratio"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        r["ttft_ratio"] = round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
        low, high = r["output_tok_s_range"]
        lines.append(f"| {r['server']} | {r['workload']} | {r['output_tok_s']:.1f} | {low:.1f}-{high:.1f} | "
                     f"{r['tok_s_ratio']:.2f}x | {r['ttft_p50_ms']:.0f} | {r['ttft_ratio']:.2f}x | "
                     f"{r['tpot_p50_ms']:.1f} | {r['front_cpu_ms_per_token']:.2f} / {r['engine_cpu_ms_per_token']:.0f} | "
                     f"{r['start_s']:.0f} | {r['loaded_s']:.0f} |")
    table = "\n".join(lines)
    print(table)
    machine = processor()
    stem = save_results(args.out, f"vs_vllm_{Path(args.model).name}", args.tag,
                        {"model": args.model, "processor": machine, "prompts": args.prompts,
                         "concurrency": args.concurrency, "runs": runs},
                        f"# ModeSwitch vs vLLM's own server ({args.model}, {machine})"
                        f"\n\nvLLM's benchmark client: {args.prompts} prompts, {args.concurrency} concurrent, "
                        f"greedy, ignore-eos; {args.repeats} run(s) per row, other prompts each"
                        f"{', in rounds over all servers resident at once, the others paused' if args.interleave else ''}, "
                        f"median (range: out tok/s of each run).\n\n{table}\n")
    print(f"wrote {stem}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
