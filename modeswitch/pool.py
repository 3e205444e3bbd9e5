"""The resident mode pool: every mode loaded at once, weights shared between modes that use the same variant.

The pool turns mode data (:mod:`modeswitch.modes`) and a preset (:mod:`modeswitch.models`) into engine
workers. A mode it cannot serve is kept in the list as ``unavailable`` with the reason: the router
never sends a request there, and nothing is silently served by another mode.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from .engines.base import Engine, GenRequest, SamplingParams
from .models import Preset, local_or_hub
from .modes import ModeSpec

log = logging.getLogger(__name__)

#: Why a weights variant cannot be served yet by the transformers engine.
UNSUPPORTED_WEIGHTS = {
    "gptq": "GPTQ 4-bit weights are not served by the transformers engine yet (planned in the quantized-modes issue)",
    "int8": "INT8 weights are not served by the transformers engine yet (planned in the quantized-modes issue)",
}

# Continuous-batching KV sizing: always explicit, since the default sizes KV to 90 % of free memory (STACK.md).
CB_PAGE_SIZE = 64
CB_NUM_BLOCKS = 128
CB_MAX_BATCH_TOKENS = 512


@dataclass
class ModeState:
    """A mode as served: its spec, whether it can take requests, and (if so) its engine worker."""

    spec: ModeSpec
    status: str = "unavailable"
    reason: str = ""
    engine: Engine | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def available(self) -> bool:
        return self.status == "available"

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight if self.engine is not None else 0

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "name": spec.name,
            "status": self.status,
            "engine": "transformers",
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
        if self.engine is not None:
            out["stats"] = self.engine.stats()
        return out


def memory_headroom() -> tuple[int, float]:
    """Free bytes and free fraction of the memory the models live in (GPU if one is in use, else RAM)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        return free, free / total
    vm = psutil.virtual_memory()
    return vm.available, vm.available / vm.total


class ModePool:
    """Loads the weights each available mode needs (once per variant) and starts one engine per mode."""

    def __init__(self, preset: Preset, modes: list[ModeSpec], device: str = "auto", dtype: str = "auto") -> None:
        self.preset = preset
        self.modes: dict[str, ModeState] = {m.name: ModeState(m) for m in modes}
        self.device_name = device
        self.dtype_name = dtype
        self.tokenizer = None
        self.context_length = 0
        self.load_seconds: dict[str, float] = {}
        self._weights: dict[str, Any] = {}

    # ------------------------------------------------------------------ loading
    def load(self, progress: Callable[[str], None] = log.info) -> None:
        """Load shared weights, build every engine, warm each one up. Raises only for missing fp16 weights."""
        from transformers import AutoTokenizer

        from .engines.hf import load_causal_lm, resolve_device_dtype

        device, dtype = resolve_device_dtype(self.device_name, self.dtype_name)
        fp16_ref = local_or_hub(self.preset.fp16, f"model {self.preset.name} (fp16 weights)")
        started = time.perf_counter()
        progress(f"loading tokenizer and fp16 weights from {fp16_ref} on {device} as {dtype}")
        self.tokenizer = AutoTokenizer.from_pretrained(fp16_ref)
        self._weights["fp16"] = load_causal_lm(fp16_ref, device, dtype, f"model {self.preset.name} (fp16 weights)")
        self.context_length = int(getattr(self._weights["fp16"].config, "max_position_embeddings", 2048))
        self.load_seconds["weights:fp16"] = time.perf_counter() - started

        for state in self.modes.values():
            t0 = time.perf_counter()
            try:
                self._build(state, device, dtype)
            except Exception as exc:  # a mode that cannot be built is listed, never fatal
                log.exception("mode %s could not be built", state.name)
                state.status, state.reason, state.engine = "unavailable", f"failed to start: {exc}", None
            if state.engine is not None:
                self._warm_up(state)
            self.load_seconds[f"mode:{state.name}"] = time.perf_counter() - t0
            progress(f"mode {state.name}: {state.status}{' (' + state.reason + ')' if state.reason else ''}")

    def _build(self, state: ModeState, device, dtype) -> None:
        from .engines.hf import ContinuousBatchingEngine, GenerateEngine, load_causal_lm
        from .engines.prefix_kv import PrefixKVStore

        spec = state.spec
        if spec.weights in UNSUPPORTED_WEIGHTS:
            state.reason = UNSUPPORTED_WEIGHTS[spec.weights]
            return
        model = self._weights[spec.weights]
        if spec.batching == "continuous":
            state.engine = ContinuousBatchingEngine(
                spec.name, model, spec.max_queue, CB_NUM_BLOCKS, CB_MAX_BATCH_TOKENS, CB_PAGE_SIZE
            )
            state.details["sampling"] = False
        else:
            draft_model, lookup = None, None
            if spec.speculative is not None:
                wants_model = spec.speculative.draft == "model" or (spec.speculative.draft == "auto" and self.preset.draft)
                if wants_model:
                    if not self.preset.draft:
                        state.reason = f"draft: model, but preset {self.preset.name} names no draft model"
                        return
                    if "draft" not in self._weights:
                        ref = local_or_hub(self.preset.draft, f"draft model of {self.preset.name}")
                        self._weights["draft"] = load_causal_lm(ref, device, dtype, f"draft model of {self.preset.name}")
                    draft_model = self._weights["draft"]
                    state.details["draft"] = self.preset.draft
                else:
                    lookup = spec.speculative.num_tokens
                    state.details["draft"] = f"ngram (prompt lookup, {lookup} tokens)"
            store = PrefixKVStore(spec.prefix_cache_tokens) if spec.prefix_cache else None
            state.engine = GenerateEngine(spec.name, model, spec.max_queue, store, draft_model, lookup)
        state.status, state.reason = "available", ""

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

    # ------------------------------------------------------------------ queries
    def available(self) -> list[ModeState]:
        return [m for m in self.modes.values() if m.available]

    def prefix_match(self, prompt_ids: list[int]) -> int:
        """Longest prompt prefix whose KV any prefix-cache mode holds (the controller's feature)."""
        best = 0
        for state in self.modes.values():
            store = getattr(state.engine, "prefix_store", None)
            if store is not None:
                best = max(best, store.match_length(prompt_ids))
        return best

    def in_flight(self) -> int:
        return sum(m.in_flight for m in self.modes.values())

    def resident_bytes(self) -> int:
        seen = {id(m): m for m in self._weights.values()}
        return sum(p.numel() * p.element_size() for m in seen.values() for p in m.parameters())

    def describe(self) -> list[dict[str, Any]]:
        return [m.describe() for m in self.modes.values()]

    def close(self) -> None:
        for state in self.modes.values():
            if state.engine is not None:
                state.engine.close()
