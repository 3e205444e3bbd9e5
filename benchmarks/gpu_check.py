"""Every target of issue 16 in one in-process run: the owned static-cache loop and each mode riding it.

On the lent H200 (``--device cuda --shape llama-3.1-8b``, random bf16 weights of the 8B shape, batch 1, 512-token
prompt) it measures, with a time budget so the whole run stays under 8 minutes:
  1. fp16 decode ms/token against the HBM floor (weight bytes / measured copy bandwidth);
  2. int8 weight-only and int4 tinygemm ms/token and NVML J/token, each as a ratio to fp16;
  3. prefix_cache decode ms/token, and the TTFT of a prompt whose first 90 % is cached, against fp16's;
  4. one verify step of k=5 drafts against one decode step, and the expected speculative speed-up from the
     n-gram acceptance measured on the real demo model (``--acceptance FILE``: a CPU run's JSON that has it);
  5. continuous batching (transformers' manager with CUDA graphs) ms/token at 1 request, tokens/s at 8;
  6. each mode's warm-up (compile + graph capture) seconds.
Everything runs through the engines the server uses (StaticLoopEngine, ContinuousBatchingEngine), not copies.

``--device cpu --shape tiny`` is the dry run of the same code (a small random Llama, minutes on 2 cores), and
with the demo model present it also measures the n-gram acceptance the GPU run reads. Needs torch and
transformers only (no flask, bitsandbytes, lm-eval or vLLM: the GPU machine has none of them).

    python benchmarks/gpu_check.py --device cuda --shape llama-3.1-8b --out "$OUT" --acceptance FILE.json
    python benchmarks/gpu_check.py --device cpu --shape tiny --out benchmarks/results --tag cpu-dryrun
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from make_random_llama import SHAPES  # noqa: E402

from modeswitch.backends.checkpoint import CB_MAX_BATCH_TOKENS, CB_NUM_BLOCKS, CB_PAGE_SIZE  # noqa: E402
from modeswitch.energy import open_meter  # noqa: E402
from modeswitch.engines.base import GenRequest  # noqa: E402
from modeswitch.sampling_params import SamplingParams  # noqa: E402
from modeswitch.engines.static.drafts import NgramDrafter  # noqa: E402
from modeswitch.engines.transformers.engines import ContinuousBatchingEngine  # noqa: E402
from modeswitch.engines.transformers.prefix_kv import PrefixKVStore  # noqa: E402
from modeswitch.engines.static.loop import StaticLoopEngine  # noqa: E402
from modeswitch.weights.kernels import quantize_int4_rtn, quantize_int8_weight_only  # noqa: E402

#: per shape: prompt tokens, generated tokens, context (static cache), int4 group size
RUN = {"llama-3.1-8b": dict(prompt=512, tokens=128, ctx=2048, group=128),
       "tiny": dict(prompt=64, tokens=24, ctx=256, group=64)}
VERIFY_K = 5
CONCURRENT = 8


class Budget:
    """Skips what would start after ``seconds`` of the run (the GPU check must end inside its 8 minutes)."""

    def __init__(self, seconds: float, only: frozenset[str] = frozenset()) -> None:
        self.seconds, self.started, self.only = seconds, time.perf_counter(), only
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def allows(self, section: str) -> bool:
        if self.only and section not in self.only:  # --sections: not asked for this run
            return False
        if self.elapsed() < self.seconds:
            return True
        self.skipped.append(section)
        print(f"[budget] {self.elapsed():.0f} s spent: skipping {section}", flush=True)
        return False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large device-to-device copy moves (read + write): the decode floor's denominator."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n / best


def random_llama(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=None, pad_token_id=2,
                         tie_word_embeddings=False, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: run every request to max_tokens
    return model


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class Timed:
    """One request's token arrival times, tokens and NVML energy (None without NVML)."""

    def __init__(self, engine, prompt: list[int], max_tokens: int, meter) -> None:
        self.req = GenRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens))
        self.meter = meter
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.info: dict[str, Any] = {}
        self.joules_decode: float | None = None
        self.start = time.perf_counter()
        engine.submit(self.req)

    def wait(self) -> "Timed":
        j_first = None
        while True:
            event = self.req.events.get(timeout=600)
            if event.kind == "error":
                raise RuntimeError(event.info)
            if event.kind == "done":
                self.info = event.info
                break
            now = time.perf_counter()
            if not self.times and self.meter is not None:
                j_first = self.meter.joules()
            self.times += [now] * len(event.token_ids)
            self.tokens += event.token_ids
        if j_first is not None:
            self.joules_decode = self.meter.joules() - j_first
        return self

    @property
    def ttft_ms(self) -> float:
        return (self.times[0] - self.start) * 1e3

    @property
    def decode_ms(self) -> float:
        return (self.times[-1] - self.times[0]) * 1e3 / max(1, len(self.times) - 1)

    @property
    def j_per_token(self) -> float | None:
        return None if self.joules_decode is None else self.joules_decode / max(1, len(self.times) - 1)


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def measure_loop(name: str, engine: StaticLoopEngine, run: dict, meter, results: dict) -> Timed:
    warm = engine.warm_up()
    Timed(engine, prompt_ids(run["prompt"], 99), 4, None).wait()  # first real request: allocator, caches
    timed = Timed(engine, prompt_ids(run["prompt"], 1), run["tokens"], meter).wait()
    results["modes"][name] = {"warmup_s": round(warm, 2), "ttft_ms": round(timed.ttft_ms, 2),
                              "decode_ms_per_token": round(timed.decode_ms, 3),
                              "j_per_token": None if timed.j_per_token is None else round(timed.j_per_token, 4)}
    print(f"{name}: warm-up {warm:.1f} s, TTFT {timed.ttft_ms:.1f} ms, {timed.decode_ms:.2f} ms/token", flush=True)
    return timed


def step_times(engine: StaticLoopEngine, k: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one decode step and one verify step of ``k`` drafts, on the engine's own thread."""
    decoder = engine.decoder

    def run() -> tuple[float, float]:
        out = []
        for fn in (lambda: decoder.decode(7, 100), lambda: decoder.verify([7] * (k + 1), 100)):
            fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                sync(decoder.device)
                times.append(time.perf_counter() - t)
            out.append(sorted(times)[len(times) // 2])
        return out[0], out[1]

    return engine.call(run)


def demo_acceptance(k: int) -> dict | None:
    """n-gram acceptance of the real demo model (greedy, eager loop on the CPU) on two workloads: continuing
    held-out prose, and quoting a passage back (the copy-heavy work prompt lookup is for)."""
    from modeswitch.weights.corpus import heldout_paragraphs
    from modeswitch.device import resolve_device_dtype
    from modeswitch.weights.presets import PRESETS
    from modeswitch.weights.store import VariantUnavailable, WeightStore, load_tokenizer

    device, dtype = resolve_device_dtype("cpu", "auto")
    store = WeightStore(PRESETS["demo"], device, dtype)
    try:
        model = store.get("fp16", progress=lambda s: None)
    except VariantUnavailable as exc:
        print(f"acceptance: demo model unavailable ({exc})")
        return None
    tok = load_tokenizer(store.ref("fp16"), "demo tokenizer")
    paragraphs = [p for p in heldout_paragraphs() if len(p) > 400][:4]
    workloads = {
        "continue": [tok(p[:600]).input_ids for p in paragraphs],
        "quote": [tok(p[:400] + "\n\nThe passage above, word for word:\n" + p[:40]).input_ids for p in paragraphs],
    }
    out = {}
    for name, prompts in workloads.items():
        engine = StaticLoopEngine(f"acceptance-{name}", model, 8, 1024, drafter=NgramDrafter(k))
        try:
            for ids in prompts:
                Timed(engine, ids, 32, None).wait()
            c = engine.counters
        finally:
            engine.close()
        out[name] = {"tokens_per_step": round(c["spec_tokens"] / c["spec_steps"], 3),
                     "verify_fraction": round(c["verify_steps"] / c["spec_steps"], 3), "prompts": len(prompts)}
        print(f"acceptance ({name}): {out[name]}", flush=True)
    return out


def expected_speedup(acc: dict, t_decode: float, t_verify: float) -> float:
    """Decode time per token over speculative time per token: each target step yields ``tokens_per_step``
    tokens and is a verify step ``verify_fraction`` of the time (else a decode step)."""
    f = acc["verify_fraction"]
    return t_decode * acc["tokens_per_step"] / (f * t_verify + (1 - f) * t_decode)


def cb_section(model, run: dict, graphs: bool, fp16_ms: float, results: dict) -> None:
    started = time.perf_counter()
    engine = ContinuousBatchingEngine("cb", model, 64, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS, CB_PAGE_SIZE, graphs=graphs)
    try:
        Timed(engine, prompt_ids(run["prompt"], 99), 4, None).wait()  # compiles / captures on first use
        warm = time.perf_counter() - started
        # The manager hands tokens over in bursts, so per-token arrival times say little: decode time per token is
        # the difference between a long and a short request's wall time, over the difference in tokens.
        short = Timed(engine, prompt_ids(run["prompt"], 98), 4, None).wait()
        one = Timed(engine, prompt_ids(run["prompt"], 1), run["tokens"], None).wait()
        walls = [(r.times[-1] - r.start) * 1e3 for r in (short, one)]
        decode_ms = (walls[1] - walls[0]) / (len(one.tokens) - len(short.tokens))
        t = time.perf_counter()
        reqs = [Timed(engine, prompt_ids(run["prompt"], 10 + i), run["tokens"], None) for i in range(CONCURRENT)]
        tokens = sum(len(r.wait().tokens) for r in reqs)
        wall = time.perf_counter() - t
    finally:
        engine.close()
    tps = tokens / wall
    results["modes"]["continuous_batching"] = {
        "warmup_s": round(warm, 2), "decode_ms_per_token": round(decode_ms, 3), "ttft_ms": round(one.ttft_ms, 2),
        f"tokens_per_s_{CONCURRENT}": round(tps, 1), "cuda_graphs": graphs}
    print(f"continuous_batching: 1 request {decode_ms:.2f} ms/token; {CONCURRENT} concurrent {tps:.0f} tok/s "
          f"(fp16 alone {1e3 / fp16_ms:.0f})", flush=True)


def section(budget: Budget, name: str, fn: Callable[[], None], results: dict) -> None:
    if not budget.allows(name):
        return
    try:
        fn()
    except Exception as exc:  # one target failing must not cost the others their measurement
        results["errors"][name] = f"{exc.__class__.__name__}: {str(exc)[:500]}"
        print(f"[error] {name}: {results['errors'][name]}", flush=True)
        traceback.print_exc()  # an assertion's message is often empty: the frame is what says which


def targets(r: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, bound, met) rows of the issue's table from the results."""
    m = r["modes"]
    fp = m.get("fp16", {})
    rows: list[tuple[str, str, str, bool | None]] = []

    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    def row(target: str, value: float | None, bound: float, fmt: str = "{:.2f}x", le: bool = True) -> None:
        met = None if value is None else (value <= bound if le else value >= bound)
        rows.append((target, "–" if value is None else fmt.format(value), ("<= " if le else ">= ") + fmt.format(bound),
                     met))

    row("1 fp16 ms/token / HBM floor", ratio(fp.get("decode_ms_per_token"), r.get("hbm_floor_ms")), 1.5)
    for name, bound in (("int8", 0.65), ("int4", 0.45)):
        row(f"2 {name} ms/token vs fp16", ratio(m.get(name, {}).get("decode_ms_per_token"), fp.get("decode_ms_per_token")), bound)
        row(f"2 {name} J/token vs fp16", ratio(m.get(name, {}).get("j_per_token"), fp.get("j_per_token")), bound)
    pc = m.get("prefix_cache", {})
    row("3 prefix_cache decode vs fp16", ratio(pc.get("decode_ms_per_token"), fp.get("decode_ms_per_token")), 1.1)
    row("3 prefix_cache TTFT (90 % cached) vs fp16", ratio(pc.get("ttft_ms"), fp.get("ttft_ms")), 0.3)
    sp = m.get("speculative", {})
    row(f"4 verify k={VERIFY_K} step / decode step", sp.get("verify_over_decode"), 1.3)
    for name, speedup in sp.get("expected_speedup", {}).items():
        rows.append((f"4 expected n-gram speed-up ({name}, demo acceptance)", f"{speedup:.2f}x", "report", None))
    cb = m.get("continuous_batching", {})
    row("5 CB ms/token at 1 vs fp16", ratio(cb.get("decode_ms_per_token"), fp.get("decode_ms_per_token")), 1.3)
    fp_tps = None if not fp.get("decode_ms_per_token") else 1e3 / fp["decode_ms_per_token"]
    row(f"5 CB tok/s at {CONCURRENT} vs fp16", ratio(cb.get(f"tokens_per_s_{CONCURRENT}"), fp_tps), 4.0, le=False)
    warm = sum(v.get("warmup_s", 0) for v in m.values())
    row("6 all modes warm (s)", warm if m else None, 180.0, fmt="{:.0f}")
    return rows


def markdown(r: dict) -> str:
    lines = [f"# gpu_check {r['tag']}: {r['device_name']}, shape {r['shape']} ({r['dtype']})", "",
             f"torch {r['torch']}, transformers {r['transformers']}; prompt {r['run']['prompt']} tokens, "
             f"{r['run']['tokens']} generated, batch 1; compile mode {r['compile']}; bandwidth "
             f"{r['bandwidth_gbs']:.0f} GB/s, weights {r['weights_gb']:.2f} GB, HBM floor {r['hbm_floor_ms']:.3f} ms; "
             f"wall {r['wall_s']:.0f} s.", "",
             *(["**A CPU dry run**: it shows that the script and every mode's path run end to end; the bounds are the "
                "H200's and say nothing about a tiny model on a CPU.", ""] if r["device"] == "cpu" else []),
             "| target | measured | bound | met |", "|---|---|---|---|"]
    for target, value, bound, met in targets(r):
        lines.append(f"| {target} | {value} | {bound} | {'–' if met is None else 'yes' if met else 'NO'} |")
    lines += ["", "| mode | warm-up s | TTFT ms | ms/token | J/token |", "|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        lines.append(f"| {name} | {m.get('warmup_s', '–')} | {m.get('ttft_ms', '–')} | "
                     f"{m.get('decode_ms_per_token', '–')} | {m.get('j_per_token') if m.get('j_per_token') is not None else '–'} |")
    if r.get("acceptance"):
        lines += ["", f"n-gram acceptance, demo model on the CPU (k={VERIFY_K}): {json.dumps(r['acceptance'])}"]
    if r["errors"] or r["skipped"]:
        lines += ["", f"errors: {json.dumps(r['errors'])}; skipped (budget): {r['skipped']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(RUN), default="llama-3.1-8b")
    ap.add_argument("--out", required=True, help="directory for the JSON and markdown results")
    ap.add_argument("--tag", default=None, help="results file tag (default: device-shape)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no new section after this many seconds")
    ap.add_argument("--acceptance", default=None, help="a CPU run's JSON with the demo model's n-gram acceptance")
    ap.add_argument("--no-acceptance", action="store_true", help="CPU: do not measure acceptance on the demo model")
    ap.add_argument("--compile", default=None, help="torch.compile mode (default: reduce-overhead on cuda, "
                    "default on cpu; 'none' runs the loop eager)")
    ap.add_argument("--sections", default="", help="comma-separated sections to run (default: all), e.g. int8,int4")
    args = ap.parse_args()
    budget = Budget(args.budget_s, frozenset(filter(None, args.sections.split(","))))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_mode = args.compile or ("reduce-overhead" if device.type == "cuda" else "default")
    compile_mode = None if compile_mode == "none" else compile_mode
    run = RUN[args.shape]
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < (5, 19):  # the loop's cache layer follows 5.19's StaticLayer (lazy init, positions)
        print(f"warning: transformers {transformers.__version__} < 5.19; the static-cache loop was written against "
              "5.19 (carry its wheel in .gpu/whl/ if a section fails)", flush=True)

    meter = open_meter() if device.type == "cuda" else None
    results: dict[str, Any] = {  # benchmark, tag and date: what benchmarks/digest.py reads (see report.save_results)
        "benchmark": "gpu_check", "tag": args.tag or f"{args.device}-{args.shape}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape, "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "transformers": transformers.__version__,
        "compile": compile_mode, "run": run, "energy": "nvml" if meter is not None else None,
        "modes": {}, "errors": {}, "skipped": budget.skipped}
    results["bandwidth_gbs"] = copy_bandwidth(device) / 1e9
    model = random_llama(args.shape, device, dtype)
    results["weights_gb"] = weight_bytes(model) / 1e9
    results["hbm_floor_ms"] = weight_bytes(model) / (results["bandwidth_gbs"] * 1e9) * 1e3
    print(f"{args.shape} on {results['device_name']}: {results['weights_gb']:.2f} GB, floor "
          f"{results['hbm_floor_ms']:.3f} ms/token", flush=True)
    loop = dict(compile=compile_mode)

    def fp16() -> None:
        engine = StaticLoopEngine("fp16", model, 8, run["ctx"], **loop)
        try:
            measure_loop("fp16", engine, run, meter, results)
        finally:
            engine.close()

    def prefix() -> None:
        engine = StaticLoopEngine("prefix_cache", model, 8, run["ctx"], prefix_store=PrefixKVStore(4 * run["ctx"]),
                                  **loop)
        try:
            base = prompt_ids(run["prompt"], 1)
            engine.warm_up()
            Timed(engine, prompt_ids(run["prompt"], 5), 1, None).wait()  # prime one unrelated entry
            Timed(engine, base, 1, None).wait()  # the shared prefix, stored
            cached = int(run["prompt"] * 0.9)
            ids = base[:cached] + prompt_ids(run["prompt"] - cached, 7)
            timed = Timed(engine, ids, run["tokens"], meter).wait()
            results["modes"]["prefix_cache"] = {
                "warmup_s": round(engine.warmup_s, 2), "ttft_ms": round(timed.ttft_ms, 2),
                "decode_ms_per_token": round(timed.decode_ms, 3), "cached_tokens": timed.info["cached_tokens"],
                "j_per_token": None if timed.j_per_token is None else round(timed.j_per_token, 4)}
            print(f"prefix_cache: {timed.info['cached_tokens']} cached, TTFT {timed.ttft_ms:.1f} ms, "
                  f"{timed.decode_ms:.2f} ms/token", flush=True)
        finally:
            engine.close()

    def speculative() -> None:
        engine = StaticLoopEngine("speculative", model, 8, run["ctx"], drafter=NgramDrafter(VERIFY_K), **loop)
        try:
            warm = engine.warm_up()
            t_dec, t_ver = step_times(engine, VERIFY_K, 30)
        finally:
            engine.close()
        entry = {"warmup_s": round(warm, 2), "decode_step_ms": round(t_dec * 1e3, 3),
                 "verify_step_ms": round(t_ver * 1e3, 3), "verify_over_decode": round(t_ver / t_dec, 3)}
        acc = results.get("acceptance")
        if acc:
            entry["expected_speedup"] = {name: round(expected_speedup(a, t_dec, t_ver), 3) for name, a in acc.items()}
        results["modes"]["speculative"] = entry
        print(f"speculative: decode step {t_dec * 1e3:.2f} ms, verify k={VERIFY_K} {t_ver * 1e3:.2f} ms "
              f"({t_ver / t_dec:.2f}x); expected {entry.get('expected_speedup')}", flush=True)

    def quantized(name: str, quantize: Callable[[Any], int]) -> Callable[[], None]:
        def go() -> None:
            qmodel = copy.deepcopy(model)
            started = time.perf_counter()
            layers = quantize(qmodel)
            seconds = time.perf_counter() - started
            engine = StaticLoopEngine(name, qmodel, 8, run["ctx"], **loop)
            try:
                measure_loop(name, engine, run, meter, results)
            finally:
                engine.close()
            results["modes"][name].update(quantize_s=round(seconds, 2), layers=layers,
                                          weights_gb=round(weight_bytes(qmodel) / 1e9, 3))
            del engine, qmodel
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return go

    if args.acceptance:
        results["acceptance"] = json.loads(Path(args.acceptance).read_text()).get("acceptance")
    elif device.type == "cpu" and not args.no_acceptance:
        section(budget, "acceptance", lambda: results.__setitem__("acceptance", demo_acceptance(VERIFY_K)), results)
    section(budget, "fp16", fp16, results)
    section(budget, "int8", quantized("int8", quantize_int8_weight_only), results)
    section(budget, "int4", quantized("int4", lambda m: quantize_int4_rtn(m, run["group"])), results)
    section(budget, "prefix_cache", prefix, results)
    section(budget, "speculative", speculative, results)
    fp16_ms = results["modes"].get("fp16", {}).get("decode_ms_per_token", float("nan"))
    section(budget, "continuous_batching", lambda: cb_section(model, run, device.type == "cuda", fp16_ms, results),
            results)
    results["wall_s"] = round(budget.elapsed(), 1)
    results["dynamo"] = {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ("stats", "graph_break")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{results['tag']}"  # report.results_stem's naming (this script does not import report)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (out / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out / stem}.json and .md; threads left: {threading.active_count()}")


if __name__ == "__main__":
    main()
