"""ModeSwitch against vLLM's own OpenAI server, driven by vLLM's own benchmark client, on one machine.

Each server is started alone (nothing else running), then ``vllm bench serve`` sends the same workloads to
it: ``random`` (256 -> 32 tokens) and ``prefix_repetition`` (2 prefixes of 256 tokens + 32-token suffixes ->
32 tokens), 16 prompts at 4 concurrent clients (``--prompts``, ``--concurrency``), greedy, ignore-eos. The table gives output tokens/s and
median TTFT per server and workload, with each one's ratio to vLLM's server from the same run; JSON with the
client's full results lands in benchmarks/results/. ``--repeats N`` sends each workload N times to the same
server, each time with other prompts (seed 0..N-1: nothing is in the prefix cache from the time before), and
reports the median and the range: one run of 16 short prompts moves by 5-10 %. For a ModeSwitch server the
JSON also keeps how many requests each mode served (``/v1/modes``), over all its runs.

    .venv/bin/python benchmarks/vs_vllm.py [--model demo] [--modeswitch "label=serve.py flags" ...]
                                           [--vllm "label=ENV=VALUE ..." ...] [--repeats N]

Defaults compare vLLM's server (as it starts by default; the first ``--vllm`` row is the reference of every
ratio, further rows start it with other environment settings) with ``make serve``'s default (every reference
mode on vLLM engines, the batch-first policy, the shipped quality gate report enforced), with the same modes
under the reference design's paper policy, and with one vLLM engine serving fp16 alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor  # noqa: E402
from modeswitch.launcher import ROOT, free_port, start_server  # noqa: E402

CLI = str(Path(__file__).resolve().parent / "vllm_cli.py")
WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                          "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "2",
                          "--prefix-repetition-output-len", "32"],
}
DEFAULT_MODESWITCH = [
    "make serve default=",
    "all modes on vLLM, paper policy=--engine vllm --policy policies/paper.yaml",
    "vLLM, fp16 alone=--engine vllm --modes fp16 --policy policies/fp16.yaml",
]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def start_vllm(model_dir: str, name: str, log_dir: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen, str, float]:
    """vLLM's own OpenAI server on a free port, fp32 like ModeSwitch's CPU engines; (process, URL, start s)."""
    port = free_port()
    log = (log_dir / f"vllm-server-{port}.log").open("w")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           **extra_env}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, CLI, "serve", model_dir, "--served-model-name", name, "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "8192"], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - started < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}; see {log.name}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, time.perf_counter() - started
        except requests.ConnectionError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"vLLM's server not ready in 900 s; see {log.name}")


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
                    help="'label=ENV=VALUE ...' for one vLLM server (repeatable; default: one, as it starts by default)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=1, help="runs per workload and server, other prompts each (median)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts a run")
    ap.add_argument("--concurrency", type=int, default=4, help="the client's concurrent requests")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from modeswitch.models import local_or_hub, resolve_preset

    model_dir = local_or_hub(resolve_preset(args.model).fp16, "fp16 weights")
    workloads = args.workloads.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        vllm = [(label, None, dict(kv.split("=", 1) for kv in shlex.split(env)))
                for label, env in (s.split("=", 1) for s in args.vllm or ["vLLM's own server="])]
        servers = vllm + [(*s.split("=", 1), None) for s in args.modeswitch or DEFAULT_MODESWITCH]
        for label, flags, env in servers:
            print(f"starting {label} ...", flush=True)
            if flags is None:
                proc, url, start_s = start_vllm(model_dir, args.model, tmp, env)
            else:
                t0 = time.perf_counter()
                proc, url, _ = start_server(tmp, "--model", args.model, *shlex.split(flags), wait_s=900)
                start_s = time.perf_counter() - t0
            try:
                for workload in workloads:
                    results = [bench(url, args.model, model_dir, workload, tmp / f"{len(runs)}-{seed}.json", seed,
                                     args.prompts, args.concurrency) for seed in range(args.repeats)]
                    tok_s = [r["output_throughput"] for r in results]
                    runs.append({"server": label, "flags": flags, "env": env, "workload": workload,
                                 "start_s": round(start_s, 1), "output_tok_s": statistics.median(tok_s),
                                 "output_tok_s_range": [min(tok_s), max(tok_s)],
                                 "ttft_p50_ms": statistics.median(r["median_ttft_ms"] for r in results),
                                 "tpot_p50_ms": statistics.median(r["median_tpot_ms"] for r in results),
                                 "completed": sum(r["completed"] for r in results), "client": results})
                    print(f"  {workload}: {runs[-1]['output_tok_s']:.1f} out tok/s ({', '.join(f'{t:.1f}' for t in tok_s)}),"
                          f" TTFT p50 {runs[-1]['ttft_p50_ms']:.0f} ms", flush=True)
                if flags is not None:
                    cards = requests.get(f"{url}/v1/modes", timeout=30).json()["modes"]
                    served = {c["name"]: c["stats"]["requests"] for c in cards if c.get("stats", {}).get("requests")}
                    print(f"  requests by mode: {served}", flush=True)
                    for r in runs:
                        if r["server"] == label:
                            r["requests_by_mode"] = served
            finally:
                stop(proc)
    ref = {}
    for r in runs:  # the first vLLM server is the reference
        if r["flags"] is None:
            ref.setdefault(r["workload"], r)
    lines = ["| server | workload | out tok/s | range | vs vLLM | TTFT p50 ms | vs vLLM | TPOT p50 ms | start s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        base = ref[r["workload"]]
        r["tok_s_ratio"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        r["ttft_ratio"] = round(r["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
        low, high = r["output_tok_s_range"]
        lines.append(f"| {r['server']} | {r['workload']} | {r['output_tok_s']:.1f} | {low:.1f}-{high:.1f} | "
                     f"{r['tok_s_ratio']:.2f}x | {r['ttft_p50_ms']:.0f} | {r['ttft_ratio']:.2f}x | "
                     f"{r['tpot_p50_ms']:.1f} | {r['start_s']:.0f} |")
    table = "\n".join(lines)
    print(table)
    stem = f"{date.today()}_vs_vllm_{Path(args.model).name}_{platform.machine()}" + (f"_{args.tag}" if args.tag else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = processor()
    (out / f"{stem}.json").write_text(json.dumps({"model": args.model, "processor": machine, "prompts": args.prompts,
                                                  "concurrency": args.concurrency, "runs": runs}, indent=1))
    (out / f"{stem}.md").write_text(f"# ModeSwitch vs vLLM's own server ({args.model}, {machine})"
                                    f"\n\nvLLM's benchmark client: {args.prompts} prompts, {args.concurrency} concurrent, "
                                    f"greedy, ignore-eos; {args.repeats} run(s) per row, other prompts each, "
                                    f"median (range: out tok/s of each run).\n\n{table}\n")
    print(f"wrote {out / stem}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
