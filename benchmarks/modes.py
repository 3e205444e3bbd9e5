"""Every mode side by side, over real HTTP, in one run: the modes benchmark.

Starts ``serve.py`` (extra server flags after ``--``), then for every available mode, pinned:
  * batch 1: TTFT, decode tokens/s and ms/token for a --prompt-tokens prompt and --max-tokens new tokens
    (median over --repeats held-out prompts; prefix-cache modes also repeat them: "warm" = a cache hit);
  * --concurrency requests at once (each level of a list, default 4 and 16): aggregate output tokens/s (who
    batches, who queues), and its ratio to the fp16 mode's, the reference on the same engine;
  * what each mode's linears run (its /v1/modes kernels card: weights x activations, kernel);
  * energy per generated token at both batch sizes where NVML is present (GPU), else left out;
  * peak memory: the server's peak RSS while the mode ran (CPU), or device memory in use (GPU);
  * greedy-token agreement with fp16 on the same prompts; speculative tokens per target step;
  * held-out perplexity per weights variant (--perplexity; loads the variants in this process);
  * the controller's decision time: server-side per request, and an in-process loop (--decision-loop).
Prompts are held-out Jargon File prose (modeswitch.weights.corpus). Writes JSON and markdown to
benchmarks/results/. Machines are noisy: compare ratios within one run.

    python benchmarks/modes.py                                  # the demo model on this machine
    python benchmarks/modes.py --model /tmp/llama8b --tag h200 -- --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import requests
from tqdm import tqdm

from modeswitch.bench.client import pct, stream_completion
from modeswitch.bench.report import save_results
from modeswitch.weights.corpus import heldout_paragraphs, token_windows
from modeswitch.energy import open_meter
from modeswitch.serving.launcher import ROOT, start_server
from modeswitch.weights.quality import common_prefix


def stream_once(url: str, prompt_ids: list[int], mode: str, max_tokens: int) -> dict:
    """One streamed greedy request pinned to ``mode``: client-side TTFT and decode rate, text, server report."""
    record = stream_completion(url, prompt_ids, max_tokens, mode)
    if not record["ok"]:
        raise RuntimeError(f"mode {mode}: {record['status']} {record['error']}")
    record["decode_tok_s"] = 1 / record["tpot_s"] if record["tpot_s"] else 0.0
    return record


def concurrent(url: str, batch: list[list[int]], mode: str, max_tokens: int) -> tuple[int, float]:
    def one(p):
        r = requests.post(url + "/v1/completions", timeout=900, json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "mode": mode})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        total = sum(pool.map(one, batch))
    return total, time.perf_counter() - t0


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Energy:
    """Joules used by a block of work (NVML counter), or None without NVML."""

    def __init__(self) -> None:
        self.meter = open_meter()

    def measure(self, fn):
        if self.meter is None:
            return fn(), None
        before = self.meter.joules()
        out = fn()
        return out, self.meter.joules() - before


def perplexities(model_arg: str, variants: list[str]) -> dict[str, float]:
    from modeswitch.device import resolve_device_dtype
    from modeswitch.weights.presets import resolve_preset
    from modeswitch.weights.quality import perplexity
    from modeswitch.weights.store import WeightStore
    from transformers import AutoTokenizer

    device, dtype = resolve_device_dtype("auto", "auto")
    store = WeightStore(resolve_preset(model_arg), device, dtype)
    tok = AutoTokenizer.from_pretrained(store.ref("fp16"))
    out = {}
    for v in variants:
        out[v] = perplexity(store.get(v, progress=lambda s: None), tok)
        del store.models[v]
    return out


def decision_loop(server_args: list[str], n: int = 20000) -> dict:
    """Controller cost in-process: the real registry and policy, varied features, n decisions."""
    import random

    from modeswitch.sampling_params import SamplingParams
    from modeswitch.compose import build_service
    from modeswitch.server import build_parser, config_from_args

    service = build_service(config_from_args(build_parser().parse_args(server_args)), progress=lambda s: None)
    rng = random.Random(0)
    ids = [[rng.randrange(1000, 2000) for _ in range(rng.choice([16, 128, 512, 1024]))] for _ in range(64)]
    dec, feat = [], []
    for i in range(n):
        params = SamplingParams(max_tokens=rng.choice([16, 64, 256]), temperature=rng.choice([0.0, 0.7]))
        t0 = time.perf_counter()
        f = service.features(ids[i % len(ids)], params)
        t1 = time.perf_counter()
        service.controller.decide(f)
        t2 = time.perf_counter()
        feat.append((t1 - t0) * 1e6)
        dec.append((t2 - t1) * 1e6)
    service.registry.close()
    return {"n": n, "decide_us_p50": pct(dec, 0.5), "decide_us_p99": pct(dec, 0.99),
            "features_us_p50": pct(feat, 0.5), "features_us_p99": pct(feat, 0.99)}


def run_mode(url, proc, m, tok, args, energy, prompts, batch, reference) -> tuple[dict, list]:
    name = m["name"]
    can_reset = reset_peak_rss(proc.pid)
    runs, joules1 = energy.measure(lambda: [stream_once(url, p, name, args.max_tokens) for p in prompts])
    warm = [stream_once(url, p, name, args.max_tokens) for p in prompts] if m["prefix_cache"] else []
    row = {"mode": name, "weights": m["weights"], "decode_path": m.get("decode", "batched"),
           "kernels": m.get("kernels"), "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
           "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}
    for c in args.concurrency:
        (total, seconds), joules = energy.measure(lambda: concurrent(url, batch[:c], name, args.max_tokens))
        row[f"concurrent{c}_tok_s"] = total / seconds
        if joules is not None:
            row[f"j_per_token_bs{c}"] = joules / total
    row["ms_per_token"] = 1e3 / row["decode_tok_s"] if row["decode_tok_s"] else None
    generated = sum(r["tokens"] for r in runs)
    if joules1 is not None:
        row["j_per_token_bs1"] = joules1 / generated
        row["gpu_mem_used_gb"] = energy.meter.memory_used() / 2**30
    elif can_reset:
        row["peak_rss_mb"] = proc_status(proc.pid, "VmHWM") / 2**20
    if reference is not None:
        agree = [common_prefix(tok(r["text"]).input_ids, tok(ref).input_ids) / max(1, len(tok(ref).input_ids))
                 for r, ref in zip(runs, reference)]
        row["agreement_with_fp16"] = statistics.mean(agree)
    if warm:
        row["warm_ttft_ms"] = statistics.median(r["ttft_s"] for r in warm) * 1e3
        row["warm_cached_tokens"] = statistics.median(r["cached_tokens"] for r in warm)
    spec = [r["speculative"] for r in runs if r["speculative"]]
    if spec:
        steps = sum(s["target_steps"] for s in spec)
        row["spec_tokens_per_step"] = (steps + sum(s["accepted_draft_tokens"] for s in spec)) / steps
    return row, runs + warm


def main() -> int:
    argv = sys.argv[1:]
    server_extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--extra-modes", action="store_true", help="also load modes/extra (speculative variants)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="4,16", type=lambda v: [int(c) for c in v.split(",")],
                    help="comma-separated numbers of concurrent requests to measure (default 4,16)")
    ap.add_argument("--measure", default=None,
                    help="comma-separated modes to measure (default: every available mode); the server still loads "
                         "every mode its flags name, so a vLLM engine's batch is the one it has in service")
    ap.add_argument("--perplexity", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decision-loop", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tag", default="", help="the variant, a file name suffix for the results (modes_<model>_<tag>)")
    ap.add_argument("--log-dir", default=None, help="where the server log goes (default: a temp directory)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    # every mode is measured, pinned, so the quality gate (which would refuse failing ones) is off here
    server_args = ["--model", args.model, "--gate-report", "none", *server_extra]
    if args.extra_modes:
        server_args += ["--modes-dir", str(ROOT / "modes"), "--modes-dir", str(ROOT / "modes" / "extra")]
    energy = Energy()
    t0 = time.perf_counter()
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="modeswitch-bench-"))
    proc, url, _ = start_server(log_dir, *server_args, wait_s=1800)
    start_s = time.perf_counter() - t0
    try:
        info = requests.get(url + "/v1/modes").json()
        measure = set(args.measure.split(",")) if args.measure else None
        modes = sorted((m for m in info["modes"] if m["status"] == "available" and (measure is None or m["name"] in measure)),
                       key=lambda m: m["name"] != "fp16")
        unavailable = {m["name"]: m["reason"] for m in info["modes"] if m["status"] != "available"}
        from modeswitch.weights.presets import local_or_hub, resolve_preset

        tok = AutoTokenizer.from_pretrained(local_or_hub(resolve_preset(args.model).fp16, "tokenizer"))
        windows = token_windows(tok, heldout_paragraphs(), args.repeats + max(args.concurrency), args.prompt_tokens)
        prompts, batch = windows[: args.repeats], windows[args.repeats:]
        rows, decisions, reference = [], [], None
        for m in tqdm(modes, desc="modes", unit="mode"):
            row, runs = run_mode(url, proc, m, tok, args, energy, prompts, batch, reference)
            if m["name"] == "fp16":
                reference = [r["text"] for r in runs[: len(prompts)]]
                row["agreement_with_fp16"] = 1.0
            decisions += [r["decision_us"] for r in runs if r["decision_us"] is not None]
            rows.append(row)
            tqdm.write(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
        final = requests.get(url + "/v1/modes").json()
        memory = final["memory"]
        engines = {"backend": final.get("backend"), "engines": final.get("engines"),
                   "startup_seconds": final.get("startup_seconds")}
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    fp16 = next((r for r in rows if r["mode"] == "fp16"), None)
    for r in rows:
        if fp16 and fp16["decode_tok_s"] and r["decode_tok_s"]:
            r["ttft_vs_fp16"] = r["ttft_ms"] / fp16["ttft_ms"]
            r["decode_vs_fp16"] = r["decode_tok_s"] / fp16["decode_tok_s"]
            r["ms_per_token_vs_fp16"] = r["ms_per_token"] / fp16["ms_per_token"]
            for c in args.concurrency:
                r[f"concurrent{c}_vs_fp16"] = r[f"concurrent{c}_tok_s"] / fp16[f"concurrent{c}_tok_s"]
    variants = sorted({r["weights"] for r in rows})
    ppl = perplexities(args.model, variants) if args.perplexity else {}
    loop = decision_loop(server_args) if args.decision_loop else None
    import torch
    import transformers

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "gpu": energy.meter.name if energy.meter else None},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": args.model, "server_args": server_args, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "concurrency": args.concurrency,
        "server_start_s": start_s, "memory": memory, **engines, "unavailable": unavailable, "perplexity": ppl,
        "server_decision_us": {"p50": pct(decisions, 0.5), "p99": pct(decisions, 0.99), "n": len(decisions)},
        "decision_loop": loop, "modes": rows,
    }
    md = render(result)
    save_results(args.out, f"modes_{Path(args.model).name}", args.tag, result, md)
    print(md)
    return 0


def render(r: dict) -> str:
    levels = r["concurrency"]
    gpu = r["machine"]["gpu"]
    lines = [f"# Modes benchmark: {r['model']} ({r['date']})", "",
             f"{gpu or r['machine']['platform']}, {r['machine']['cpus']} CPUs; torch {r['versions']['torch']}, "
             f"transformers {r['versions']['transformers']}. Prompt {r['prompt_tokens']} tokens, "
             f"{r['max_tokens']} new tokens, greedy, median of {r['repeats']}; server flags {' '.join(r['server_args'])}.",
             "", f"Server start (spawn to /health 200, weights and warm-up included): {r['server_start_s']:.1f} s. "
             f"Weights resident: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["memory"]["weights_bytes"].items())
             + f" (total {r['memory']['weights_total_bytes'] / 2**20:.0f} MiB).", ""]
    mem_col = "J/token bs1 / bs" + "/".join(map(str, levels)) if gpu else "peak RSS MB"
    concurrent_cols = " | ".join(f"tok/s {c} clients (vs fp16)" for c in levels)
    lines += [f"| mode | linears | decode | TTFT ms | ms/token (vs fp16) | {concurrent_cols} | {mem_col} | "
              f"agreement w/ fp16 | notes |", "|---|---|---|---|---|" + "---|" * len(levels) + "---|---|---|"]
    for m in r["modes"]:
        notes = []
        if "warm_ttft_ms" in m:
            notes.append(f"warm TTFT {m['warm_ttft_ms']:.0f} ms ({m['warm_cached_tokens']:.0f} cached)")
        if "spec_tokens_per_step" in m:
            notes.append(f"{m['spec_tokens_per_step']:.2f} tokens/target step")
        if gpu:
            mem = " / ".join(f"{m[f'j_per_token_bs{c}']:.3f}" for c in (1, *levels))
        else:
            mem = f"{m['peak_rss_mb']:.0f}" if m.get("peak_rss_mb") else "n/a"
        k = m.get("kernels")
        linears = f"{k['weights']} x {k['activations']}, {k['kernel']}" if k else "n/a"
        ms = f"{m['ms_per_token']:.1f} ({m.get('ms_per_token_vs_fp16', 1):.2f}x)" if m.get("ms_per_token") else "n/a"
        concurrent_cells = " | ".join(f"{m[f'concurrent{c}_tok_s']:.1f} ({m.get(f'concurrent{c}_vs_fp16', 1):.2f}x)"
                                      for c in levels)
        lines.append(f"| {m['mode']} | {linears} | {m['decode_path']} | {m['ttft_ms']:.0f} | {ms} | {concurrent_cells} | "
                     f"{mem} | {m.get('agreement_with_fp16', float('nan')):.2f} | {'; '.join(notes)} |")
    if r["perplexity"]:
        lines += ["", "Held-out perplexity (Jargon File prose, 8 x 256 tokens): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["perplexity"].items()) + "."]
    if r["unavailable"]:
        lines += ["", "Unavailable: " + "; ".join(f"{k} ({v})" for k, v in r["unavailable"].items()) + "."]
    d, loop = r["server_decision_us"], r["decision_loop"]
    lines += ["", f"Controller decision (gates + policy), server-side over {d['n']} requests: "
              f"p50 {d['p50']:.1f} µs, p99 {d['p99']:.1f} µs."]
    if loop:
        lines.append(f"In-process loop of {loop['n']} decisions: decide p50 {loop['decide_us_p50']:.1f} µs, "
                     f"p99 {loop['decide_us_p99']:.1f} µs; features (prefix radix walks + memory reading) "
                     f"p50 {loop['features_us_p50']:.1f} µs, p99 {loop['features_us_p99']:.1f} µs.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
