"""A backend that needs no weights: every mode is a :class:`~modeswitch.testing.engine.FakeEngine`.

It satisfies :class:`~modeswitch.backends.base.Backend`, so the real registry, controller, service and HTTP
app run on top of it unchanged; what a test needs (a slow mode, a failing mode, a mode that cannot be
served here) is said per mode in :class:`Script` objects or ``unavailable`` reasons.
"""

from __future__ import annotations

import threading
from typing import Any, Collection, Mapping

from ..backends.base import BuiltMode, ModelInfo, Progress
from ..memory import Footprint, MemoryPlan
from ..modes import ModeSpec
from ..weights.store import VariantUnavailable
from .engine import FakeEngine, Script
from .tokenizer import ByteTokenizer

#: sizes the memory plan shows for a fake mode (nothing is allocated)
WEIGHTS_BYTES = 1 << 20
KV_BYTES_PER_TOKEN = 1024


#: how long a held mode's build waits for :attr:`FakeBackend.release` before it fails (a test that waits for a mode it
#: should not, a staged start that leads with the wrong one, fails instead of hanging)
HELD_S = 30.0


class FakeBackend:
    name = "fake"
    device = "cpu"

    def __init__(self, scripts: Mapping[str, Script] | None = None, unavailable: Mapping[str, str] | None = None,
                 context_length: int = 2048, default: Script = Script(), held: Collection[str] = (),
                 kernels: Mapping[str, Mapping[str, str]] | None = None, gate_key: str = "fake") -> None:
        """``scripts``: how each mode behaves (others follow ``default``: instant); ``unavailable``: modes that
        cannot be served here, with the reason the registry shows; ``held``: modes whose build waits until
        :attr:`release` is set (an engine still starting); ``kernels``: the linear-kernel card a mode's engine
        reports (:class:`~modeswitch.weights.precision.LinearKernels`; others report none); ``gate_key``: the
        engine whose shipped gate report the server enforces (none is shipped for ``fake``: the gate is off; a
        test of what a server does with the shipped report names a real one, and ``kernels`` that report has no
        run on, so that the server scores them as it would on a new machine)."""
        self.held, self.release = frozenset(held), threading.Event()
        self.scripts = dict(scripts or {})
        self.default = default
        self.unavailable = dict(unavailable or {})
        self.context_length = context_length
        self.engines: dict[str, FakeEngine] = {}
        self.kernels = dict(kernels or {})
        self.gate_key = gate_key

    def open(self, progress: Progress) -> ModelInfo:
        return ModelInfo(ByteTokenizer(), self.context_length, KV_BYTES_PER_TOKEN)

    def footprint(self, spec: ModeSpec) -> Footprint:
        if spec.name in self.unavailable:
            raise VariantUnavailable(self.unavailable[spec.name])
        kv = self.context_length * KV_BYTES_PER_TOKEN
        return Footprint(spec.name, spec.weights, kv, f"one sequence of {self.context_length} tokens",
                         {spec.weights: WEIGHTS_BYTES})

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        if spec.name in self.held and not self.release.wait(HELD_S):
            raise VariantUnavailable(f"held {HELD_S:.0f} s and never released: a staged start waited for it")
        engine = self.engines[spec.name] = FakeEngine(spec, self.scripts.get(spec.name, self.default))
        details: dict[str, Any] = {"script": repr(engine.script)}
        if engine.script.cpus:
            details["cpus"] = list(engine.script.cpus)
        if spec.name in self.kernels:
            details["kernels"] = dict(self.kernels[spec.name])
        return BuiltMode(engine, details)

    def resident_weights(self) -> dict[str, int]:
        return {}

    def startup_seconds(self) -> dict[str, float]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
