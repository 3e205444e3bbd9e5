"""Per-mode serving benchmark over real HTTP: start time, TTFT, decode tok/s, concurrency, peak RSS, decision cost.

Starts ``serve.py`` (demo model unless --model), then for every available mode, pinned, side by side in one run:
  * TTFT and decode tokens/s for a ~512-token prompt and 64 new tokens (median of --repeats distinct prompts;
    prefix_cache also repeats its prompts: "warm" rows show what a cache hit buys);
  * aggregate tokens/s for 8 concurrent requests (shows who batches and who queues);
  * the server's peak RSS while the mode ran (VmHWM, reset per mode through /proc/PID/clear_refs);
  * the controller's decision time: server-side per request, and an in-process loop of 20,000 decisions.
Prompts are slices of Python's LICENSE text (ships with every CPython). Writes JSON and markdown to
benchmarks/results/. Numbers are for one machine and one moment: compare the ratios within a run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import requests
from tqdm import tqdm

from modeswitch.launcher import ROOT, start_server


def license_text() -> str:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.is_file():
        path = Path(sys.base_prefix) / "LICENSE.txt"
    return path.read_text()


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    ids = tokenizer(license_text()).input_ids
    step = max(1, (len(ids) - tokens) // max(n, 1))
    return [ids[i * step: i * step + tokens] for i in range(n)]


def stream_once(url: str, prompt_ids: list[int], mode: str, max_tokens: int) -> dict:
    """One streamed request; client-side TTFT and decode rate, plus the server's modeswitch report."""
    t0 = time.perf_counter()
    resp = requests.post(url + "/v1/completions", stream=True, timeout=600, json={
        "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "mode": mode, "stream": True,
        "stream_options": {"include_usage": True}})
    resp.raise_for_status()
    first = last = None
    report, tokens = {}, 0
    for line in resp.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0]["text"]:
            now = time.perf_counter()
            first = first or now
            last = now
        if "modeswitch" in chunk:
            report.update(chunk["modeswitch"])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return {"ttft_s": (first or time.perf_counter()) - t0,
            "decode_tok_s": (tokens - 1) / (last - first) if first and last and last > first else 0.0,
            "decision_us": report.get("decision_us"), "cached_tokens": report.get("cached_tokens", 0),
            "speculative": report.get("speculative")}


def concurrent_rate(url: str, batch: list[list[int]], mode: str, max_tokens: int) -> float:
    def one(p):
        r = requests.post(url + "/v1/completions", timeout=600, json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "mode": mode})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        total = sum(pool.map(one, batch))
    return total / (time.perf_counter() - t0)


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


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def decision_loop(model: str, n: int = 20000) -> dict:
    """Controller cost in-process: the real pool and policy, varied features, n decisions."""
    import random

    from modeswitch.server import build_parser, build_service
    from modeswitch.engines.base import SamplingParams

    service = build_service(build_parser().parse_args(["--model", model]), progress=lambda s: None)
    rng = random.Random(0)
    ids = [[rng.randrange(1000, 2000) for _ in range(rng.choice([16, 128, 512, 1024]))] for _ in range(64)]
    dec, feat = [], []
    for i in range(n):
        p = ids[i % len(ids)]
        params = SamplingParams(max_tokens=rng.choice([16, 64, 256]), temperature=rng.choice([0.0, 0.7]))
        t0 = time.perf_counter()
        f = service.features(p, params)
        t1 = time.perf_counter()
        service.controller.decide(f)
        t2 = time.perf_counter()
        feat.append((t1 - t0) * 1e6)
        dec.append((t2 - t1) * 1e6)
    service.pool.close()
    return {"n": n, "decide_us_p50": pct(dec, 0.5), "decide_us_p99": pct(dec, 0.99),
            "features_us_p50": pct(feat, 0.5), "features_us_p99": pct(feat, 0.99)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    import tempfile

    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="modeswitch-bench-"))
    t0 = time.perf_counter()
    proc, url, log_file = start_server(tmp, "--model", args.model)
    start_s = time.perf_counter() - t0
    try:
        modes = [m for m in requests.get(url + "/v1/modes").json()["modes"] if m["status"] == "available"]
        from modeswitch.models import local_or_hub, resolve_preset

        tok = AutoTokenizer.from_pretrained(local_or_hub(resolve_preset(args.model).fp16, "tokenizer"))
        base_rss = proc_status(proc.pid, "VmRSS")
        batch_prompts = prompts(tok, args.concurrency, 128)
        rows, decisions = [], []
        bar = tqdm(total=len(modes) * (args.repeats + 1), desc="modes", unit="run")
        for m in modes:
            name = m["name"]
            can_reset = reset_peak_rss(proc.pid)
            runs = []
            for p in prompts(tok, args.repeats, args.prompt_tokens):
                runs.append(stream_once(url, p, name, args.max_tokens))
                bar.update()
            warm = [stream_once(url, p, name, args.max_tokens) for p in prompts(tok, args.repeats, args.prompt_tokens)] \
                if m["prefix_cache"] else []
            decisions += [r["decision_us"] for r in runs + warm if r["decision_us"] is not None]
            rate = concurrent_rate(url, batch_prompts, name, args.max_tokens)
            bar.update()
            row = {"mode": name,
                   "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
                   "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                   f"concurrent{args.concurrency}_tok_s": rate,
                   "peak_rss_mb": proc_status(proc.pid, "VmHWM") / 2**20 if can_reset else None}
            if warm:
                row["warm_ttft_ms"] = statistics.median(r["ttft_s"] for r in warm) * 1e3
                row["warm_cached_tokens"] = statistics.median(r["cached_tokens"] for r in warm)
            spec = [r["speculative"] for r in runs if r["speculative"]]
            if spec:
                steps = sum(s["target_steps"] for s in spec)
                row["spec_tokens_per_step"] = (steps + sum(s["accepted_draft_tokens"] for s in spec)) / steps
            rows.append(row)
        bar.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    loop = decision_loop(args.model)
    fp16 = next((r for r in rows if r["mode"] == "fp16"), None)
    for r in rows:
        if fp16:
            r["ttft_vs_fp16"] = r["ttft_ms"] / fp16["ttft_ms"]
            r["decode_vs_fp16"] = r["decode_tok_s"] / fp16["decode_tok_s"]
    import torch
    import transformers

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": __import__("os").cpu_count()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": args.model, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "server_start_s": start_s, "rss_after_load_mb": base_rss / 2**20,
        "server_decision_us": {"p50": pct(decisions, 0.5), "p99": pct(decisions, 0.99), "n": len(decisions)},
        "decision_loop": loop, "modes": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"modes_{args.model.replace('/', '_')}_{platform.machine()}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    md = render(result, args.concurrency)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


def render(r: dict, conc: int) -> str:
    lines = [f"# Modes benchmark: {r['model']} ({r['date']})", "",
             f"{r['machine']['platform']}, {r['machine']['cpus']} CPUs; torch {r['versions']['torch']}, "
             f"transformers {r['versions']['transformers']}. Prompt {r['prompt_tokens']} tokens, "
             f"{r['max_tokens']} new tokens, greedy, median of {r['repeats']}.", "",
             f"Server start (process spawn to /health 200): {r['server_start_s']:.1f} s; "
             f"RSS after load {r['rss_after_load_mb']:.0f} MB.", "",
             f"| mode | TTFT ms | decode tok/s | vs fp16 (TTFT / decode) | {conc} concurrent tok/s | peak RSS MB | notes |",
             "|---|---|---|---|---|---|---|"]
    for m in r["modes"]:
        notes = []
        if "warm_ttft_ms" in m:
            notes.append(f"warm TTFT {m['warm_ttft_ms']:.0f} ms ({m['warm_cached_tokens']:.0f} cached tokens)")
        if "spec_tokens_per_step" in m:
            notes.append(f"{m['spec_tokens_per_step']:.2f} tokens/target step")
        rss = f"{m['peak_rss_mb']:.0f}" if m.get("peak_rss_mb") else "n/a"
        lines.append(f"| {m['mode']} | {m['ttft_ms']:.0f} | {m['decode_tok_s']:.1f} | "
                     f"{m.get('ttft_vs_fp16', 1):.2f} / {m.get('decode_vs_fp16', 1):.2f} | "
                     f"{m[f'concurrent{conc}_tok_s']:.1f} | {rss} | {'; '.join(notes)} |")
    d, loop = r["server_decision_us"], r["decision_loop"]
    lines += ["", f"Controller decision (gates + policy), server-side over {d['n']} requests: "
              f"p50 {d['p50']:.1f} µs, p99 {d['p99']:.1f} µs.",
              f"In-process loop of {loop['n']} decisions: decide p50 {loop['decide_us_p50']:.1f} µs, "
              f"p99 {loop['decide_us_p99']:.1f} µs; features (prefix radix walk + memory reading) "
              f"p50 {loop['features_us_p50']:.1f} µs, p99 {loop['features_us_p99']:.1f} µs.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
