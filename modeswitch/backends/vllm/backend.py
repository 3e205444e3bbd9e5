"""The vLLM backend: the :class:`~modeswitch.backends.base.Backend` that serves modes on the fewest vLLM engines,
each in its own processes with its own weights and KV.

It composes one part per job: which engines serve the modes and what each runs with, on which cores
(:mod:`.layout`); starting them, staged or not, and compiling behind (:mod:`.start`); each engine as served, its
runner and its modes' fronts (:mod:`.served`); and watching them, restarts included (``backends.supervision``,
shared with the transformers backend).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...config import LoadConfig
from ...engines.vllm import compat as vllm_compat
from ...engines.vllm.engine import VllmFront
from ...memory import Footprint, MemoryPlan
from ...modes import ModeSpec
from ...weights.presets import Preset
from ..base import BuiltMode, ModelInfo, Progress
from ..checkpoint import Checkpoint
from ..supervision import Supervisor
from .layout import EngineLayout
from .served import ServedEngine, decode
from .start import EngineStarts

log = logging.getLogger(__name__)


class VllmBackend:
    name = gate_key = "vllm"

    def __init__(self, preset: Preset, load: LoadConfig) -> None:
        self.checkpoint = Checkpoint(preset, load)
        self.device = str(self.checkpoint.device)
        self.layout = EngineLayout(self.checkpoint)
        closing = threading.Event()  # set by close: nothing is started again from then on
        self.supervisor = Supervisor("vllm", load, closing)
        self.starts = EngineStarts(self.layout, load, closing, self._serving)
        #: the engines built so far, by key
        self.engines: dict[str, ServedEngine] = {}
        self._plan: MemoryPlan | None = None

    def _serving(self, key: str) -> ServedEngine | None:
        served = self.engines.get(key)
        return None if served is None or self.supervisor.down(key) else served

    @property
    def _eager_comeback(self) -> bool:
        """Whether an engine that dies comes back eager and is compiled behind: where the server compiles, on a CPU
        (loading Inductor's compiled graphs is most of a restart there; on a GPU a second copy of the engine would
        not fit beside the first in vLLM's memory check, so it comes back as it was)."""
        return self.starts.compiled and self.checkpoint.device.type == "cpu"

    def _recompile(self, served: ServedEngine) -> None:
        """An engine that died serves again eager: compiled again behind its requests."""
        self.starts.compile_behind(served, served.key, lambda line: log.info("%s", line),
                                   "it came back eager after a restart")

    def open(self, progress: Progress) -> ModelInfo:
        info = self.checkpoint.open()  # missing weights are said first: the check below imports vLLM's workers
        vllm_compat.require()  # an untested vLLM is refused here, with one line, before any engine starts
        return info

    def footprint(self, spec: ModeSpec) -> Footprint:
        return self.layout.footprint(spec)

    def build(self, spec: ModeSpec, plan: MemoryPlan, progress: Progress) -> BuiltMode:
        """The mode's front on its engine, the engine started first where it is not up yet."""
        key = self.layout.key(spec)
        self.layout.first = self.layout.first or key
        self._plan = plan
        runner = self.starts.runner(key, plan, progress)
        served = self.engines.get(key)
        if served is None:
            served = self.engines[key] = ServedEngine(key, runner, plan.users[key], self.supervisor.closing,
                                                      self._recompile if self._eager_comeback else None)
        runner = served.runner  # compiled behind or started again since
        details: dict[str, Any] = {"vllm_engine": key, "decode": decode(runner),
                                   "kernels": {**runner.kernels, "engine": f"vllm:{key}"}}
        if runner.cpus:
            details["cpus"] = runner.cpus
        if (draft := runner.engine_args.get("speculative_config")) is not None:
            # the engine drafts for its speculative modes: every request on it takes vLLM's drafting path (its
            # costs are measured apart from an engine's that does not, see ``controller.costs.stream_key``)
            details["engine_drafts"] = draft.get("method") or draft.get("model")
            if spec.speculative is not None:
                details["draft"] = details["engine_drafts"]
        drafts = spec.speculative.num_tokens if spec.speculative is not None else 0
        engine = VllmFront(spec.name, runner, spec.prefix_cache, drafts)
        served.add(engine, details)
        engine.restarts = self.supervisor.watch(key, served)
        return BuiltMode(engine, details, self.checkpoint.step_cost(plan.weights[key]), batch=key)

    def resident_weights(self) -> dict[str, int]:
        """None here: every engine holds its weights in its own engine-core process (see :meth:`describe`)."""
        return {}

    def startup_seconds(self) -> dict[str, float]:
        return {f"vllm:{key}": t for key, t in self.starts.start_s.items()}

    def describe(self) -> dict[str, Any]:
        """Per engine: the modes on it, its start time, deaths and restarts, what the plan gives it, and the
        runner's own state (processes, measured memory, steps, KV blocks)."""
        return {key: {"modes": served.modes, "startup_s": round(self.starts.start_s[key], 2),
                      "status": self.supervisor.status(key),
                      **{k.removeprefix("engine_"): v for k, v in self.supervisor.restarts[key].stats().items()},
                      "planned_bytes": self._plan.holder_bytes(key) if self._plan else None,
                      **served.runner.describe()}
                for key, served in self.engines.items()}

    def close(self) -> None:
        """Stop every engine; those still starting are killed rather than waited for. The engines stop
        together: vLLM gives each engine-core process up to 5 s to leave after SIGTERM before it kills it, and
        engines stopped one after another would add those waits up."""
        self.supervisor.close()  # no engine is started again from now on
        owned = {pid for served in self.engines.values() for pid in served.runner.pids}
        self.starts.stop_starting(owned, self.supervisor.any_down())
        starting = self.starts.starting

        def stop(key: str) -> None:
            try:
                runner = self.engines[key].runner if key in self.engines else starting[key].result()
            except Exception:  # it never started: nothing to stop
                return
            runner.close()

        with ThreadPoolExecutor(max_workers=max(len(starting), 1), thread_name_prefix="vllm-stop") as pool:
            list(pool.map(stop, list(starting)))
