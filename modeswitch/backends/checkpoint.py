"""The served model's checkpoints as both real backends plan them: resolved, measured from their configs,
sized per mode. Nothing here loads weights; the transformers backend loads them, vLLM engines load their own.
"""

from __future__ import annotations

import time

from ..config import LoadConfig
from ..device import resolve_device_dtype
from ..energy import HARDWARE, StepCost
from ..engines.grammar import Grammars
from ..memory import ModelShape
from ..modes import ModeSpec
from ..weights.presets import Preset, WeightsNotFound, demo_to_build, prepare_in_subprocess
from ..weight_kinds import REFERENCE
from ..weights.store import VariantUnavailable, WeightStore, load_config, load_tokenizer
from .base import ModelInfo

# Continuous-batching KV sizing, always explicit: left to itself, transformers sizes the paged pool to 90 % of
# free memory (and decodes many times slower on a CPU for it). The vLLM plan reserves the same pool for these modes.
CB_PAGE_SIZE = 64
CB_NUM_BLOCKS = 128
CB_MAX_BATCH_TOKENS = 512


class Checkpoint:
    """The preset's weight variants on one device: where each is, what it weighs, what each mode reserves."""

    def __init__(self, preset: Preset, load: LoadConfig) -> None:
        self.preset = preset
        self.device, self.dtype = resolve_device_dtype(load.device, load.dtype)
        self.max_model_len = load.max_model_len
        #: compiled decode: on by default on a GPU, where eager decode is launch-bound (CUDA graphs replay a step
        #: instead of launching its kernels one by one); on a CPU, where there are no CUDA graphs and compiling adds
        #: minutes to a start, only when asked
        self.compiled_decode = load.decode == "compiled" or (load.decode == "auto" and self.device.type == "cuda")
        self.weights = WeightStore(preset, self.device, self.dtype, compiled_kernels=self.compiled_decode)
        self.shape: ModelShape | None = None
        self.context_length = 0
        self._draft_shape: ModelShape | None = None
        self.grammars: Grammars | None = None
        self._info: ModelInfo | None = None

    def open(self) -> ModelInfo:
        """Resolve the reference weights and read their config and tokenizer, once (engine families sharing this
        checkpoint share what it read); raises WeightsNotFound."""
        if self._info is not None:
            return self._info
        try:
            ref = self.weights.ref(REFERENCE.name)
        except VariantUnavailable as exc:  # without the reference weights nothing can be served
            raise WeightsNotFound(str(exc)) from None
        config = load_config(ref, f"{REFERENCE.name} weights of {self.preset.name}")
        self.shape = ModelShape.from_config(config, self.dtype.itemsize)
        self.context_length = min(int(getattr(config, "max_position_embeddings", self.max_model_len)),
                                  self.max_model_len)
        tokenizer = load_tokenizer(ref, f"tokenizer of {self.preset.name}")
        #: constrained requests' grammars, compiled against the logits' width (the config's vocabulary, which may
        #: be padded past the tokenizer's)
        self.grammars = Grammars(tokenizer, config.vocab_size)
        self._info = ModelInfo(tokenizer, self.context_length, self.shape.kv_bytes_per_token)
        return self._info

    def draft_variant(self, spec: ModeSpec) -> str | None:
        """The weights variant a speculative mode drafts with (None: prompt-lookup n-grams)."""
        draft = spec.speculative.draft
        if draft == "auto":
            return "draft" if self.preset.draft else None
        return {"model": "draft", "gptq": "gptq", "ngram": None}[draft]

    def variant_bytes(self, spec: ModeSpec) -> dict[str, int]:
        """Planned bytes of every weights variant ``spec`` keeps resident (its own first, then its draft's);
        raises VariantUnavailable when one cannot be had."""
        variants = self.variants(spec)
        for v in variants:
            self.weights.ref(v, build=False)  # planning builds nothing (a demo checkpoint is built when loaded)
        dtype_bytes = self.dtype.itemsize
        return {v: self._draft().weights_bytes(REFERENCE.name, dtype_bytes) if v == "draft"
                else self.shape.weights_bytes(v, dtype_bytes) for v in variants}

    def variants(self, spec: ModeSpec) -> list[str]:
        """The weights variants ``spec`` keeps resident: its own first, then its draft's."""
        variants = [spec.weights]
        if spec.speculative is not None and (draft := self.draft_variant(spec)) is not None:
            variants.append(draft)
        return variants

    def build_demo(self, refs: list[str], mode: str, idle: bool, progress) -> None:
        """Build the demo checkpoints among ``refs`` that are not built yet, each in a child process (under
        SCHED_IDLE with ``idle``, behind the requests served): the demo's GPTQ checkpoint takes minutes of
        calibration on a CPU, which then neither holds this process's memory nor competes with what it serves."""
        for ref in refs:
            if name := demo_to_build(ref):
                started = time.perf_counter()
                progress(f"building the demo checkpoint {name} for {mode} (once)")
                prepare_in_subprocess(name, idle)
                progress(f"demo checkpoint {name} built in {time.perf_counter() - started:.0f} s")

    def kv(self, spec: ModeSpec, variants: dict[str, int]) -> tuple[int, str]:
        """KV bytes ``spec`` reserves and how they are made up, given its weights ``variants``."""
        ctx = self.context_length
        if spec.batching == "continuous":
            tokens, detail = CB_NUM_BLOCKS * CB_PAGE_SIZE, f"paged pool of {CB_NUM_BLOCKS * CB_PAGE_SIZE} tokens"
        else:
            tokens, detail = ctx, f"one sequence of {ctx} tokens"
            if spec.prefix_cache:
                tokens += spec.prefix_cache_tokens
                detail += f" + {spec.prefix_cache_tokens} stored prefix tokens"
        kv = tokens * self.shape.kv_bytes_per_token
        if "draft" in variants:
            kv += ctx * self._draft().kv_bytes_per_token
            detail += " + draft KV"
        return kv, detail

    def _draft(self) -> ModelShape:
        """The draft model's shape, read once; a draft whose config cannot be read is unavailable."""
        if self._draft_shape is None:
            what = f"draft weights of {self.preset.name}"
            try:
                config = load_config(self.weights.ref("draft"), what)
            except WeightsNotFound as exc:
                raise VariantUnavailable(str(exc)) from None
            self._draft_shape = ModelShape.from_config(config, self.dtype.itemsize)
        return self._draft_shape

    def step_cost(self, weight_bytes: int) -> StepCost:
        """The roofline model of one step on ``weight_bytes`` of this model's weights."""
        shape = self.shape
        return StepCost(shape.matmul_params, shape.attn_width, weight_bytes, shape.kv_bytes_per_token,
                        HARDWARE.get(self.device.type, HARDWARE["cpu"]))
