"""The transformers backend: every mode in this process, weights loaded once per variant and shared.

A mode's options become constructor arguments of the two transformers workers
(:mod:`modeswitch.engines.hf`): continuous batching gets the paged-KV manager, every other mode a
``generate()`` worker with its prefix store, draft and decode path.
"""

from __future__ import annotations

from typing import Any

from ..config import LoadConfig
from ..engines.hf import ContinuousBatchingEngine, GenerateEngine
from ..engines.prefix_kv import PrefixKVStore
from ..memory import Footprint, MemoryPlan
from ..models import Preset
from ..modes import ModeSpec
from .base import BuiltMode, ModelInfo, Progress
from .checkpoint import CB_MAX_BATCH_TOKENS, CB_NUM_BLOCKS, CB_PAGE_SIZE, Checkpoint

#: Weights whose plain modes take the compiled static-cache decode on a GPU. bitsandbytes INT8 stays eager:
#: compiling a quantized 8B decode on an H200 ran over 90 s without finishing, too long for start-up.
COMPILED_WEIGHTS = ("fp16", "gptq")


class TransformersBackend:
    name = "transformers"

    def __init__(self, preset: Preset, load: LoadConfig) -> None:
        self.checkpoint = Checkpoint(preset, load)
        #: the loaded variants, shared by every mode on them (the lm-eval adapter scores with them too)
        self.weights = self.checkpoint.weights
        self.device = str(self.checkpoint.device)

    def open(self, progress: Progress) -> ModelInfo:
        return self.checkpoint.open()

    def footprint(self, spec: ModeSpec) -> Footprint:
        variants = self.checkpoint.variant_bytes(spec)
        kv, detail = self.checkpoint.kv(spec, variants)
        return Footprint(spec.name, spec.weights, kv, detail, variants)

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        model = self.weights.get(spec.weights, progress)
        details: dict[str, Any] = {}
        if spec.batching == "continuous":
            engine = ContinuousBatchingEngine(spec.name, model, spec.max_queue, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS,
                                              CB_PAGE_SIZE)
            details["sampling"] = False
        else:
            draft_model, lookup = None, None
            if spec.speculative is not None:
                variant = self.checkpoint.draft_variant(spec)
                if variant is None:
                    lookup = spec.speculative.num_tokens
                    details["draft"] = f"ngram (prompt lookup, {lookup} tokens)"
                else:
                    draft_model = self.weights.get(variant, progress)
                    draft_model.generation_config.num_assistant_tokens = spec.speculative.num_tokens
                    preset = self.checkpoint.preset
                    details["draft"] = (f"{variant} weights of {preset.name} (self-draft)" if variant == "gptq"
                                        else preset.draft)
            store = PrefixKVStore(spec.prefix_cache_tokens) if spec.prefix_cache else None
            compiled = (self.checkpoint.compiled_decode and store is None and spec.speculative is None
                        and spec.weights in COMPILED_WEIGHTS)
            static = self.checkpoint.context_length if compiled else None
            engine = GenerateEngine(spec.name, model, spec.max_queue, store, draft_model, lookup, static)
            details["decode"] = "compiled static cache" if static else "eager dynamic cache"
        return BuiltMode(engine, details, self.checkpoint.step_cost(self.weights.nbytes(spec.weights)))

    def resident_weights(self) -> dict[str, int]:
        return {v: self.weights.nbytes(v) for v in self.weights.models}

    def startup_seconds(self) -> dict[str, float]:
        return {f"weights:{v}": t for v, t in self.weights.load_seconds.items()}

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """The modes' engines are all there is to stop; the weights go with the process."""
