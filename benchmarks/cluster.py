"""Routers of the ModeSwitch cluster side by side on one prefix-heavy trace, then a replica killed mid-run.

    python benchmarks/cluster.py [--replicas 2] [--requests 48] [--prefixes 4] [--concurrency 4]

One local Ray cluster; for each router (round_robin, Ray's PrefixCacheAffinityRouter, the ModeSwitch router) a
fresh Serve application of N demo replicas (transformers engine, ``--modes``, default prefix_cache only, so the
hit rate measures placement alone) serves the same trace: ``--prefixes`` groups of requests sharing a long
prefix, each request picking its group at random, sent by ``--concurrency`` streaming clients. Reported per
router: prefix hit rate (prompt tokens whose KV a replica reused / prompt tokens), mean and p50 TTFT, mean
latency, output tok/s, requests per replica; ratios against round-robin. Then the ModeSwitch router serves the
trace again while one replica is killed once a third of it is answered: every request must get a 200 or a 503
with Retry-After, none may hang. Prints a table; writes JSON and markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modeswitch.bench.client import pct, send  # noqa: E402
from modeswitch.bench.report import save_results, summarize  # noqa: E402
from modeswitch.bench.workloads import TextSource, prefix_reuse  # noqa: E402
from modeswitch.cluster.app import ClusterConfig, application  # noqa: E402
from modeswitch.config import HttpConfig, LoadConfig, ServerConfig  # noqa: E402
from modeswitch.serving.launcher import free_port  # noqa: E402
from modeswitch.resources import POLICIES_DIR  # noqa: E402

ROUTERS = ("round_robin", "prefix_affinity", "modeswitch")


def summary(records: list[dict], seconds: float) -> dict:
    """The harness's summary (mean TTFT and latency, tokens) plus what placement changes: the prefix hit rate,
    p50 TTFT, output tok/s and how the requests spread over replicas."""
    ok = [r for r in records if r.get("ok")]
    prompt = sum(r["prompt_tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok]
    return {**summarize(records),
            "hit_rate": sum(r["cached_tokens"] or 0 for r in ok) / prompt if prompt else 0.0,
            "p50_ttft_s": pct(ttft, 0.5) if ttft else None,
            "out_tok_s": sum(r["tokens"] for r in ok) / seconds,
            "per_replica": dict(Counter(r.get("replica") for r in ok)),
            "statuses": dict(Counter(str(r.get("status", 200)) for r in records))}


def deploy(serve, args, router: str) -> float:
    """Deploy the cluster with ``router`` (``modeswitch@W``: the ModeSwitch router with prefix weight W)."""
    router, _, weight = router.partition("@")
    # the paper table: its default is prefix_cache, which every --modes here is expected to include
    server = ServerConfig(model=args.model, modes=tuple(args.modes.split(",")), gate_report="none",
                          policy=POLICIES_DIR / "paper.yaml",
                          load=LoadConfig(backend="transformers", staged=False), http=HttpConfig(drain_timeout=5))
    t0 = time.perf_counter()
    serve.run(application(ClusterConfig(server=server, replicas=args.replicas, router=router,
                                        prefix_weight=float(weight) if weight else ClusterConfig.prefix_weight)),
              name="modeswitch", route_prefix="/")
    return time.perf_counter() - t0


def killer(ray, url: str, done: list, after: int, killed: dict) -> None:
    """Kill one replica's actor once ``after`` requests have been answered."""
    import requests

    while len(done) < after:
        time.sleep(0.05)
    victim = requests.get(url + "/v1/modes", timeout=30).json()["replicas"][0]["replica"]
    actor = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"])
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
    killed.update(replica=victim, at_answered=len(done), t=time.perf_counter())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--modes", default="prefix_cache")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma-separated; modeswitch@W runs the ModeSwitch router with --prefix-weight W")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prefixes", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--prefix-fraction", type=float, default=0.75)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--no-fault", action="store_true", help="skip the killed-replica run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from modeswitch.weights.presets import local_or_hub, resolve_preset

    tokenizer = AutoTokenizer.from_pretrained(local_or_hub(resolve_preset(args.model).fp16, "tokenizer"))
    slots = prefix_reuse(TextSource(tokenizer), args.requests, 0, args.prompt_tokens, args.max_tokens,
                         args.prefix_fraction, args.prefixes)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[str, dict] = {}
    for router in args.routers.split(","):
        started = deploy(serve, args, router)
        send(url, slots[:2], concurrency=1)  # warm-up: allocator and kernels, not counted (same prefixes)
        t0 = time.perf_counter()
        records = send(url, slots, concurrency=args.concurrency)
        results[router] = {**summary(records, time.perf_counter() - t0), "startup_s": started}
        print(f"{router}: {json.dumps(results[router])}", flush=True)
        serve.delete("modeswitch")
    fault = None
    if not args.no_fault:
        deploy(serve, args, "modeswitch")
        done: list = []
        killed: dict = {}
        thread = threading.Thread(target=killer, args=(ray, url, done, len(slots) // 3, killed), daemon=True)
        thread.start()
        t0 = time.perf_counter()
        records = send(url, slots, concurrency=args.concurrency, progress=lambda: done.append(1))
        fault = {**summary(records, time.perf_counter() - t0), "killed": killed,
                 "errors": [r.get("error") for r in records if not r.get("ok")][:5]}
        print(f"fault: {json.dumps(fault)}", flush=True)
        serve.delete("modeswitch")
    serve.shutdown()
    ray.shutdown()
    write(args, results, fault)
    return 0


def write(args, results: dict, fault: dict | None) -> None:
    base = results.get("round_robin")
    lines = [f"# Cluster routers: {args.replicas} replicas of {args.model} ({args.modes}), {platform.machine()}",
             "", f"Trace: {args.requests} requests, {args.prefixes} shared prefixes of "
             f"{int(args.prompt_tokens * args.prefix_fraction)} of {args.prompt_tokens} prompt tokens, "
             f"{args.max_tokens} output tokens, {args.concurrency} streaming clients.", "",
             "| router | prefix hit rate | vs round-robin | mean TTFT s | vs round-robin | p50 TTFT s | mean latency s "
             "| out tok/s | per replica | ok |", "|---|---|---|---|---|---|---|---|---|---|"]
    for router, r in results.items():
        hit_x = f"{r['hit_rate'] / base['hit_rate']:.2f}x" if base and base["hit_rate"] else "-"
        ttft_x = f"{r['mean_ttft_s'] / base['mean_ttft_s']:.2f}x" if base and base["mean_ttft_s"] else "-"
        lines.append(f"| {router} | {r['hit_rate']:.3f} | {hit_x} | {r['mean_ttft_s']:.3f} | {ttft_x} | "
                     f"{r['p50_ttft_s']:.3f} | {r['mean_latency_s']:.3f} | {r['out_tok_s']:.1f} | "
                     f"{sorted(r['per_replica'].values())} | {r['ok']}/{r['requests']} |")
    if fault:
        lines += ["", f"Replica {fault['killed'].get('replica')} killed after {fault['killed'].get('at_answered')} "
                  f"answers (ModeSwitch router): statuses {fault['statuses']}, {fault['ok']}/{fault['requests']} ok."]
    text = "\n".join(lines) + "\n"
    print(text)
    save_results(args.out, f"cluster_{args.model}", args.tag,
                 {"args": vars(args), "routers": results, "fault": fault}, text)


if __name__ == "__main__":
    sys.exit(main())
