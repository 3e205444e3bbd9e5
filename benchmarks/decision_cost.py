"""What one routing decision costs: ``Controller.decide`` as the server calls it, with every default mode resident.

The server's own figure (``modeswitch.decision_us``, the deciding thread's CPU time) mixes the decision's work with
where it runs: between two model steps that have evicted the caches, with both cores busy. This benchmark takes the
decision alone, in process, over the fake backend (no model): the ten default modes on the default layout's engines
and cores on a 2-core CPU, the default policy, the shipped vLLM gate report, measured costs on every engine (each
lane's step growing with its load, the reference weights fastest as on an AVX2 CPU), and requests in flight on
every mode. It times the same decisions twice: back to back (``warm``), and each after a walk over ``--evict-mib``
of memory (8 MiB by default; more than the last-level cache leaves it as the engines' weights do in the server) and a
256x256 matmul (``cold``: the caches as a model step leaves them), and prints p50/p90 of the thread's CPU time;
then both again on an idle server (the same requests, nothing in flight): the part of a decision no load adds to;
then what the server does per request on that idle server, its features (``Service.features``: the prefix
matches, the memory reading, the drafting estimate, the counts) and then the decision, warm and cold; then the
decisions each after the thread slept ``--idle-ms`` (``after idle``: a lull's server between two requests, its core
idle; on a virtual machine the host may run other work on that core meanwhile, which no walk here imitates); and
last the decisions again, cold and after idle, with the cost model's predictions free (every mode answered one
fixed prediction at once): what the rest of a decision costs (gates, the policy's choice, its record), which no work
on the predictions takes off.

    .venv/bin/python benchmarks/decision_cost.py [--decisions 3000] [--evict-mib 8] [--idle-ms 2] [--tag T] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.compose import build_app  # noqa: E402
from modeswitch.config import LoadConfig, ServerConfig  # noqa: E402
from modeswitch.controller.costs import Prediction  # noqa: E402
from modeswitch.controller.curves import MIN_FIT  # noqa: E402
from modeswitch.controller.features import Features  # noqa: E402
from modeswitch.modes import load_modes  # noqa: E402
from modeswitch.resources import DEFAULT_POLICY  # noqa: E402
from modeswitch.sampling_params import SamplingParams  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402
from modeswitch.testing.backend import FakeBackend  # noqa: E402
from modeswitch.testing.engine import Script  # noqa: E402

#: the default layout on a 2-core AVX2 CPU, as the modes' cards say it: mode -> (its engine, the core it computes
#: on; None: not pinned, the GPTQ modes' in-process transformers engine)
LAYOUT = {"fp16": ("fp16", 0), "continuous_batching": ("fp16", 0), "prefix_cache": ("fp16", 0),
          "speculative": ("speculative", 1), "int8": ("int8", 0), "int8+continuous_batching": ("int8", 0),
          "int8+speculative": ("int8", 0), "int8+prefix_cache": ("int8", 0), "gptq": ("gptq", None),
          "gptq+prefix_cache": ("gptq", None)}

#: each engine's measured costs over the reference weights' (a drafting stream's steps cost half as much again)
SLOWER = {"int8": 2.0, "gptq": 3.0}
#: the tokens a drafting stream's measured requests were predicted to draft a step (its steps' line against them has
#: a slope at every load), and what one more costs a step
DRAFTS = (0.5, 3.5) * (MIN_FIT // 2 + 1)  # a stream's first step has no curve yet to be fitted over
PER_DRAFT_S = 0.002


def build(tmp: Path):
    """The server over the fake backend with every default mode on the default layout's engines and cores, costs
    measured on every stream."""
    modes = tuple(spec.name for spec in load_modes(ROOT / "modes"))
    config = ServerConfig(model="demo", modes=modes, policy=DEFAULT_POLICY,
                          gate_report=str(ROOT / "evals" / "reports" / "demo-vllm.json"), load=LoadConfig(staged=False),
                          costs_file=tmp / "costs.json", calibrate=False)
    cores = {m: () if LAYOUT[m][1] is None else (LAYOUT[m][1],) for m in modes}
    server = build_app(config, progress=lambda s: None, backend=FakeBackend({m: Script(cpus=cores[m]) for m in modes}))
    for name, state in server.service.registry.modes.items():
        state.shared_batch = LAYOUT[name][0]
    server.service.rebind()
    costs = server.service.costs
    for stream in set(costs.binding.streams.values()):  # as on an AVX2 CPU: the reference weights step fastest
        scale = SLOWER.get(stream.split()[0], 1.0) * (1.5 if stream.endswith("drafting") else 1.0)
        for tokens in (16, 64, 256, 1024):
            costs.add_prefill(stream, tokens, scale * 0.0004 * tokens)
        for load in (1, 2, 4, 8, 16):
            for drafts in DRAFTS if stream.endswith("drafting") else (None,):
                extra = 0.0 if drafts is None else PER_DRAFT_S * (drafts - sum(DRAFTS) / len(DRAFTS))
                costs.add_step(stream, load, scale * (0.030 + 0.004 * load) + extra, drafts)
        costs.add_service(stream, scale * 2.0)
    return server


def requests_in_flight(modes: list[str], n: int) -> list[Features]:
    """``n`` requests' features: prompts of 20-600 tokens, 2-5 requests in flight on every mode with a quarter to
    all of the request's tokens left, prompt tokens still to compute on some, a prefix match on the prefix-cache
    modes."""
    out = []
    for i in range(n):
        prompt = 20 + (i * 37) % 580
        in_flight = {m: 2 + (i + j) % 4 for j, m in enumerate(modes)}
        out.append(Features(
            prompt_tokens=prompt, max_tokens=32 + i % 64, prefix_match_tokens=prompt // 2, prefix_match_ratio=0.5,
            queue_depth=sum(in_flight.values()), memory_headroom=0.6, memory_free_gb=12.0, greedy=i % 2,
            prefix_match_by_mode={m: prompt // 2 for m in modes if "prefix_cache" in m},
            in_flight_by_mode=in_flight, prefilling_by_mode={m: 64 for m in modes[:: 3]},
            decode_overlap_by_mode={m: count * (0.25 + (i + j) % 4 / 4)
                                    for j, (m, count) in enumerate(in_flight.items())},
            prompt_repeat=0.3, draft_tokens_per_step=1.0 + (i % 3) / 2, drafts_per_step=(i % 4) * 1.2))
    return out


#: the memory :func:`evict` walks (``--evict-mib``), and the seconds :func:`pause` sleeps (``--idle-ms``)
_SPILL = bytearray(8 << 20)
_IDLE_S = 0.002


def evict() -> None:
    """Leave the caches as a model step does: a walk over :data:`_SPILL` and a small matmul."""
    import torch

    sum(_SPILL[::64])
    torch.randn(256, 256) @ torch.randn(256, 256)


def pause() -> None:
    """Leave the core idle a while, as a server's is between a lull's requests."""
    time.sleep(_IDLE_S)


def time_decisions(controller, features: list[Features], before: Callable[[], None] | None) -> list[float]:
    """Each decision's CPU time, ``before`` called ahead of each (None: back to back)."""
    spent = []
    for f in features:
        if before is not None:
            before()
        spent.append(controller.decide(f).decision_us)
    return spent


def time_requests(service, n: int, before: Callable[[], None] | None) -> list[float]:
    """The thread's CPU time of ``n`` requests' features and decision, as the server takes them per request:
    prompts of 20-600 tokens of their own, 48 tokens asked."""
    params = SamplingParams(max_tokens=48)
    spent = []
    for i in range(n):
        prompt = [(i * 7919 + j * 31) % 30000 for j in range(20 + (i * 37) % 580)]
        if before is not None:
            before()
        start = time.thread_time_ns()
        service.controller.decide(service.features(prompt, params))
        spent.append((time.thread_time_ns() - start) / 1e3)
    return spent


_FIXED = Prediction(1.0, 0.0, 0.0, 0.5, 0.5)


def free_predictor(features: Features, tokens_per_step: float = 1.0):
    """A stand-in for ``CostModel.predictor`` that costs nothing: every mode predicted :data:`_FIXED`."""
    def predict(mode: str) -> Prediction:
        return _FIXED

    predict.idle = frozenset()  # type: ignore[attr-defined]
    return predict


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(spent: list[float]) -> dict[str, float]:
    return {"p50_us": round(pct(spent, 0.5), 1), "p90_us": round(pct(spent, 0.9), 1),
            "mean_us": round(statistics.fmean(spent), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--evict-mib", type=int, default=8, help="memory walked before each cold decision")
    ap.add_argument("--idle-ms", type=float, default=2.0, help="the thread's sleep before each decision after idle")
    ap.add_argument("--tag", default="")
    ap.add_argument("--profile", action="store_true", help="print the warm decisions' profile instead")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    global _SPILL, _IDLE_S
    _SPILL, _IDLE_S = bytearray(args.evict_mib << 20), args.idle_ms / 1e3
    with tempfile.TemporaryDirectory() as tmp:
        server = build(Path(tmp))
        try:
            controller = server.service.controller
            modes = list(controller.modes)
            features = requests_in_flight(modes, args.decisions)
            time_decisions(controller, features[:200], None)  # every cache the decision keeps, filled
            if args.profile:
                cProfile.runctx("time_decisions(controller, features, None)", globals(), locals(), "/tmp/decide.prof")
                pstats.Stats("/tmp/decide.prof").sort_stats("tottime").print_stats(25)
                return 0
            chosen = {}
            for f in features[:200]:
                d = controller.decide(f)
                chosen[d.mode] = chosen.get(d.mode, 0) + 1
            # the same requests on an idle server (nothing in flight or queued): what the decision's path costs
            # whatever the load, which is what a lull's decisions pay
            idle = [replace(f, in_flight_by_mode={}, prefilling_by_mode={}, decode_overlap_by_mode={}, queue_depth=0)
                    for f in features]
            rows = {}
            for kind, before, asked in (("warm", None, features), ("cold", evict, features),
                                        ("warm, idle server", None, idle), ("cold, idle server", evict, idle),
                                        ("features + decision, warm, idle server", None, None),
                                        ("features + decision, cold, idle server", evict, None),
                                        ("after idle", pause, features), ("after idle, idle server", pause, idle)):
                spent = time_decisions(controller, asked, before) if asked is not None else \
                    time_requests(server.service, len(features), before)
                rows[kind] = summary(spent)
            controller.costs.predictor = free_predictor
            for kind, before, asked in (("cold, predictions free", evict, features),
                                        ("cold, idle server, predictions free", evict, idle),
                                        ("after idle, idle server, predictions free", pause, idle)):
                rows[kind] = summary(time_decisions(controller, asked, before))
        finally:
            server.close()
    lines = [f"# A decision's CPU time, and a request's features with it ({len(modes)} modes resident, default policy, "
             f"vLLM gate report; {processor()}); cold: after a walk over {args.evict_mib} MiB and a small matmul; "
             f"after idle: after {args.idle_ms:g} ms asleep",
             "", "| caches | p50 | p90 | mean |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['p50_us']} us | {v['p90_us']} us | {v['mean_us']} us |" for k, v in rows.items()]
    lines += ["", f"Chosen over 200 of the decisions: {chosen}"]
    text = "\n".join(lines)
    print(text)
    save_results(args.out, "decision_cost", args.tag, {"modes": len(modes), "decisions": args.decisions,
                                                        "evict_mib": args.evict_mib, "idle_ms": args.idle_ms,
                                                        "rows": rows, "chosen": chosen}, text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
