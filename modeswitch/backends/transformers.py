"""The transformers backend: every mode in this process, weights loaded once per variant and shared.

A mode's options become constructor arguments of the transformers workers. With compiled decode (``--decode
auto`` on a GPU, ``--decode compiled`` anywhere) every one-at-a-time mode rides the owned static-cache loop
(:mod:`modeswitch.engines.static.loop`: fp16, INT8 weight-only, GPTQ repacked for int4 tinygemm, prefix reuse,
speculative verify, all compiled) and continuous batching turns on transformers' CUDA graphs; otherwise (CPUs by
default, where the small demo is overhead-bound and compiling costs minutes) modes run eager ``generate()``
workers and the plain continuous-batching manager, as measured fastest there.
"""

from __future__ import annotations

from typing import Any

from ..config import LoadConfig
from ..engines.static.decoder import StaticDecoder
from ..engines.static.drafts import ModelDrafter, NgramDrafter
from ..engines.static.loop import StaticLoopEngine
from ..engines.transformers.engines import ContinuousBatchingEngine, GenerateEngine
from ..engines.transformers.prefix_kv import PrefixKVStore
from ..engines.transformers.worker import SerialEngine
from ..memory import Footprint, MemoryPlan
from ..modes import ModeSpec
from ..weights.precision import describe_torch_linear, first_linear
from ..weights.presets import Preset
from .base import BuiltMode, ModelInfo, Progress
from .checkpoint import CB_MAX_BATCH_TOKENS, CB_NUM_BLOCKS, CB_PAGE_SIZE, Checkpoint
from .supervision import Supervisor

#: why a speculative mode's prefix cache is off on the eager ``generate()`` workers (its card's ``prefix_cache_off``)
SPECULATIVE_FROM_CACHE = ("transformers' speculative generate() decodes other tokens from a stored cache than "
                          "from an empty one: every prompt is computed whole")


class TransformersBackend:
    name = "transformers"

    def __init__(self, preset: Preset, load: LoadConfig, checkpoint: Checkpoint | None = None,
                 repack_gptq: bool = False) -> None:
        """``checkpoint``: one another backend opened already (serving the modes it cannot, see
        ``backends.fallback``); by default its own. ``repack_gptq``: GPTQ runs PyTorch's int4 kernel even with
        eager decode (:attr:`~modeswitch.weights.store.WeightStore.repack_gptq`)."""
        self.checkpoint = checkpoint or Checkpoint(preset, load)
        #: the loaded variants, shared by every mode on them (the lm-eval adapter scores with them too)
        self.weights = self.checkpoint.weights
        self.weights.repack_gptq |= repack_gptq
        self.device = str(self.checkpoint.device)
        #: the owned loop's ``torch.compile`` mode: CUDA graphs on a GPU; None runs it eager (tests do, to build
        #: loop modes on a CPU in seconds)
        self.loop_compile: str | None = "reduce-overhead" if self.checkpoint.device.type == "cuda" else "default"
        self._warmup_s: dict[str, float] = {}
        self.gate_key = "transformers-compiled" if self.checkpoint.compiled_decode else "transformers"
        #: a staged start builds a missing demo checkpoint under SCHED_IDLE, behind the requests served
        self.staged = load.staged
        #: every mode's engine, watched on its own: a worker thread that exits, continuous batching's manager or
        #: router thread that ends, or a step past ``--engine-stall-s`` takes that mode alone out of the pool
        self.supervisor = Supervisor("transformers", load)

    def open(self, progress: Progress) -> ModelInfo:
        return self.checkpoint.open()

    def footprint(self, spec: ModeSpec) -> Footprint:
        variants = self.checkpoint.variant_bytes(spec)
        kv, detail = self.checkpoint.kv(spec, variants)
        return Footprint(spec.name, spec.weights, kv, detail, variants)

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        missing = [v for v in self.checkpoint.variants(spec) if v not in self.weights.models]
        self.checkpoint.build_demo([self.weights.ref(v, build=False) for v in missing], spec.name, self.staged,
                                   progress)
        model = self.weights.get(spec.weights, progress)
        kernels = describe_torch_linear(first_linear(model), model.dtype)
        details: dict[str, Any] = {"kernels": {**kernels.card(), "engine": f"transformers:{spec.name}"}}
        loop = self.checkpoint.compiled_decode
        if spec.batching == "continuous":
            graphs = loop and self.checkpoint.device.type == "cuda"
            engine = ContinuousBatchingEngine(spec.name, model, spec.max_queue, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS,
                                              CB_PAGE_SIZE, graphs=graphs)
            details["decode"] = "continuous batching, CUDA graphs + compiled" if graphs else "continuous batching, eager"
        elif loop:
            engine = self._loop_engine(spec, model, details, progress)
        else:
            engine = self._generate_engine(spec, model, details, progress)
        engine.restarts = self.supervisor.watch(spec.name, Watched(engine, f"transformers engine {spec.name}"))
        return BuiltMode(engine, details, self.checkpoint.step_cost(self.weights.nbytes(spec.weights)))

    def _draft_variant(self, spec: ModeSpec, details: dict[str, Any]) -> str | None:
        """The weights a speculative mode drafts with (None: n-gram lookup), named in its details."""
        variant = self.checkpoint.draft_variant(spec)
        k = spec.speculative.num_tokens
        preset = self.checkpoint.preset
        details["draft"] = (f"ngram (prompt lookup, {k} tokens)" if variant is None
                            else f"{variant} weights of {preset.name} (self-draft)" if variant == "gptq"
                            else preset.draft)
        return variant

    def _generate_engine(self, spec: ModeSpec, model, details: dict[str, Any], progress: Progress) -> GenerateEngine:
        draft_model, lookup = None, None
        if spec.speculative is not None:
            variant = self._draft_variant(spec, details)
            if variant is None:
                lookup = spec.speculative.num_tokens
            else:
                draft_model = self.weights.get(variant, progress)
                draft_model.generation_config.num_assistant_tokens = spec.speculative.num_tokens
        store = PrefixKVStore(spec.prefix_cache_tokens) if spec.prefix_cache else None
        if store is not None and spec.speculative is not None:
            store = None  # greedy output must not depend on what an earlier request left cached
            details.update(prefix_cache=False, prefix_cache_off=SPECULATIVE_FROM_CACHE)
        details["decode"] = "eager dynamic cache"
        return GenerateEngine(spec.name, model, spec.max_queue, store, draft_model, lookup, self.checkpoint.grammars)

    def _loop_engine(self, spec: ModeSpec, model, details: dict[str, Any], progress: Progress) -> StaticLoopEngine:
        """The owned loop with this mode's options, compiled and warm before it is listed as available."""
        ctx, compile = self.checkpoint.context_length, self.loop_compile
        drafter = None
        if spec.speculative is not None:
            k = spec.speculative.num_tokens
            variant = self._draft_variant(spec, details)
            if variant is None:
                drafter = NgramDrafter(k)
            else:
                draft = StaticDecoder(self.weights.get(variant, progress), ctx, compile=compile)
                drafter = ModelDrafter(draft, k)
        store = PrefixKVStore(spec.prefix_cache_tokens) if spec.prefix_cache else None
        engine = StaticLoopEngine(spec.name, model, spec.max_queue, ctx, prefix_store=store, drafter=drafter,
                                  compile=compile, grammars=self.checkpoint.grammars)
        progress(f"mode {spec.name}: {'compiling' if compile else 'warming up'} the static-cache loop")
        try:
            seconds = engine.warm_up()
        except Exception:
            engine.close()
            raise
        self._warmup_s[spec.name] = seconds
        details["decode"] = f"owned static-cache loop ({'compiled: ' + compile if compile else 'eager'})"
        details["warmup_s"] = round(seconds, 2)
        progress(f"mode {spec.name}: loop warm in {seconds:.1f} s")
        return engine

    def resident_weights(self) -> dict[str, int]:
        return {v: self.weights.nbytes(v) for v in self.weights.models}

    def startup_seconds(self) -> dict[str, float]:
        return {**{f"weights:{v}": t for v, t in self.weights.load_seconds.items()},
                **{f"warmup:{m}": t for m, t in self._warmup_s.items()}}

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """The modes' engines are all there is to stop (the registry closes them); the weights go with the
        process."""
        self.supervisor.close()


class Watched:
    """A transformers engine as the supervisor watches it: it serves again once its old thread is gone
    (:meth:`~modeswitch.engines.transformers.worker.SerialEngine.resume`: a new worker, or a new manager)."""

    def __init__(self, engine: SerialEngine | ContinuousBatchingEngine, label: str) -> None:
        self.engine = engine
        self.label = label

    def fault(self, stall_s: float) -> str | None:
        why = self.engine.fault(stall_s)
        return None if why is None else f"{self.label}: {why}"

    def abandon(self, reason: str) -> None:
        self.engine.abandon(reason)

    def resume(self) -> bool:
        return self.engine.resume()

    def report_health(self, down: str | None, restarting: bool = False) -> None:
        self.engine.report_health(down, restarting)
