"""Weight variants, each loaded at most once and shared by every mode that uses it.

Variants: ``fp16`` (the reference weights), ``gptq`` (a GPTQ 4-bit checkpoint: the preset's published
one, or the demo's, built locally), ``int8`` (bitsandbytes LLM.int8, quantized on the fly from the
reference weights) and ``draft`` (the preset's draft model for speculative decoding). With
``compiled_kernels`` (the owned static-cache loop) INT8 is int8 weight-only instead and GPTQ's 4-bit codes are
repacked for PyTorch's int4 kernel (:mod:`modeswitch.weights.kernels`): layers that compile, where LLM.int8 and
GPTQModel's kernels run eagerly (and are not installed on the GPU machine). A variant that
cannot be had here raises :class:`VariantUnavailable` with the reason the registry shows for its modes.

Models are loaded here, below the engines that run them: an engine is handed a loaded model object.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from typing import Any, Callable

from .presets import Preset, WeightsNotFound, demo_to_build, local_or_hub
from ..weight_kinds import INT8, KINDS

log = logging.getLogger(__name__)

#: how to get the Python packages a kind needs beyond the base install (``WeightKind.needs``)
QUANT_HINT = "pip install -e '.[quant]' (scripts/setup.sh installs it)"


class VariantUnavailable(RuntimeError):
    """This weights variant cannot be served here; the message says why."""


def _not_found(path_or_id: str, what: str, exc: OSError) -> WeightsNotFound:
    """transformers reports a checkpoint it cannot fetch or read as an ``OSError``: say what and how to get it."""
    return WeightsNotFound(
        f"{what}: could not load {path_or_id!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
        "download it with `huggingface-cli download ID` on a machine with access, or pass a local path")


def load_config(path_or_id: str, what: str):
    """The checkpoint's model config (what the memory planner sizes everything from)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path_or_id)
    except OSError as exc:
        raise _not_found(path_or_id, what, exc) from exc


def load_tokenizer(path_or_id: str, what: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path_or_id)
    except OSError as exc:
        raise _not_found(path_or_id, what, exc) from exc


def load_causal_lm(path_or_id: str, device, dtype, what: str, **kwargs):
    """Load a causal LM for inference on ``device``, turning "not found" into one :class:`WeightsNotFound`.

    ``device_map`` places the weights (quantized models cannot be moved with ``.to`` after loading).
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, device_map=str(device), **kwargs)
    except OSError as exc:
        raise _not_found(path_or_id, what, exc) from exc
    model = model.eval()
    serialize_forward(model)
    return model


def serialize_forward(model) -> None:
    """Make forward passes on ``model`` mutually exclusive across threads (idempotent).

    Modes that share weights share the model object, and each engine steps it from its own thread.
    transformers' forward is not re-entrant across threads: it temporarily writes ``config.is_causal``
    when a caller passes ``is_causal`` (the continuous-batching runner passes False) and restores it in a
    ``finally``; two overlapping forwards can leave ``is_causal=False`` behind for good, after which every
    plain ``generate`` prefill attends to future tokens (seen here: fp16 turned to garbage after one
    concurrent continuous-batching step). One lock per model makes engines interleave step by step.
    """
    if getattr(model, "_modeswitch_forward_lock", None) is not None:
        return
    lock = threading.Lock()
    forward = model.forward

    def locked_forward(*args, **kwargs):
        with lock:
            return forward(*args, **kwargs)

    model._modeswitch_forward_lock = lock
    model.forward = locked_forward


class WeightStore:
    def __init__(self, preset: Preset, device, dtype, compiled_kernels: bool = False) -> None:
        self.preset = preset
        self.device = device
        self.dtype = dtype
        self.compiled_kernels = compiled_kernels
        #: GPTQ repacked for PyTorch's int4 kernel (:func:`~.kernels.repack_gptq`) with eager decode too: what the
        #: transformers engine runs where it serves GPTQ for vLLM (see ``backends.fallback``)
        self.repack_gptq = compiled_kernels
        self.models: dict[str, Any] = {}
        self.load_seconds: dict[str, float] = {}
        self._refs: dict[str, str] = {}
        self._failed: dict[str, str] = {}

    def ref(self, variant: str, build: bool = True) -> str:
        """Where the variant's checkpoint is (resolving without loading); raises VariantUnavailable. A demo
        checkpoint not built yet is built now, unless ``build`` is False (planning): then its reference is
        returned unresolved, as one that can be had."""
        if variant in self._failed:
            raise VariantUnavailable(self._failed[variant])
        if variant in self._refs:
            return self._refs[variant]
        try:
            kind = KINDS.get(variant)
            needs = () if kind is None or (self.compiled_kernels and kind is INT8) else kind.needs
            missing = [p for p in needs if importlib.util.find_spec(p) is None]
            if missing:
                raise VariantUnavailable(f"{variant} weights need {', '.join(missing)}: {QUANT_HINT}")
            source = getattr(self.preset, kind.checkpoint if kind is not None else variant)
            if source is None:
                raise VariantUnavailable(f"model {self.preset.name} has no {variant} checkpoint"
                                         + (" (pass --gptq PATH_OR_ID)" if variant == "gptq" else ""))
            if not build and demo_to_build(source):
                return source
            ref = local_or_hub(source, f"{variant} weights of {self.preset.name}")
        except (VariantUnavailable, WeightsNotFound) as exc:
            self._failed[variant] = str(exc)
            raise VariantUnavailable(str(exc)) from None
        self._refs[variant] = ref
        return ref

    def get(self, variant: str, progress: Callable[[str], None] = log.info):
        """The loaded model for ``variant`` (loading it the first time)."""
        if variant in self.models:
            return self.models[variant]
        ref = self.ref(variant)
        started = time.perf_counter()
        progress(f"loading {variant} weights from {ref} on {self.device} as {self.dtype}")
        kwargs: dict[str, Any] = {}
        if variant == "int8" and not self.compiled_kernels:
            from transformers import BitsAndBytesConfig

            logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a cast warning on every CPU matmul
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
        try:
            model = load_causal_lm(ref, self.device, self.dtype, f"{variant} weights of {self.preset.name}", **kwargs)
            if self.compiled_kernels or (variant == "gptq" and self.repack_gptq):
                self._compilable(variant, model, progress)
        except Exception as exc:
            self._failed[variant] = f"{variant} weights failed to load: {exc}"
            raise VariantUnavailable(self._failed[variant]) from exc
        self.models[variant] = model
        self.load_seconds[variant] = time.perf_counter() - started
        return model

    def _compilable(self, variant: str, model, progress: Callable[[str], None]) -> None:
        """Swap the quantized layers for ones the compiled loop fuses (before any forward: GPTQModel's CPU
        kernel repacks its own tensors on first use)."""
        from .kernels import quantize_int8_weight_only, repack_gptq

        if variant == "int8":
            progress(f"int8 weight-only: {quantize_int8_weight_only(model)} layers quantized")
        elif variant == "gptq":
            progress(f"gptq: {repack_gptq(model)} layers repacked for the int4 tinygemm kernel")

    def nbytes(self, variant: str) -> int:
        """Measured resident bytes of a loaded variant (parameters and buffers)."""
        model = self.models[variant]
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
