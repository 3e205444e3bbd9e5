"""The resident modes: every mode loaded at once through one backend, each with its health and energy record.

The registry turns mode data (:mod:`modeswitch.modes`) into served modes. It plans memory from the
backend's footprints, has the backend build each mode, warms each one up, and keeps per mode what the
controller reads (available or why not, queue depth, capabilities, quarantine, J/token). A mode it cannot
serve stays in the list as ``unavailable`` with the reason: the router never sends a request there, and
nothing is silently served by another mode. Which engine family runs the modes is the backend's business.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..backends import Backend, select_backend
from ..backends.base import Progress
from ..config import LoadConfig
from ..device import device_type, free_memory, process_tree_memory
from ..energy import EnergyAccountant, meter_for
from ..engines.base import Engine, GenRequest
from ..sampling_params import OPTIONS, SamplingParams
from ..memory import MemoryPlan, fmt
from ..modes import ModeSpec
from ..weights.precision import mismatch
from ..weights.presets import Preset
from ..weights.store import VariantUnavailable

log = logging.getLogger(__name__)

#: Quarantine backoff of a failing mode: doubles per consecutive failure, within these bounds (seconds).
QUARANTINE_BASE_S = 5.0
QUARANTINE_MAX_S = 300.0
#: Memory kept free when the budget defaults to "what is free now".
DEFAULT_HEADROOM = 0.10
#: Weight of the newest request in a mode's running J/token (exponential moving average).
ENERGY_EWMA_ALPHA = 0.2
#: How long a warm-up request may take before its mode is given up (first calls compile on a GPU).
WARM_UP_TIMEOUT_S = 300


def _running(old: float | None, value: float) -> float:
    """An exponential moving average's next value (the first sample starts it)."""
    return value if old is None else old + ENERGY_EWMA_ALPHA * (value - old)


class Standing:
    """Counts the changes to the standing of a registry's modes: what the controller's standing gates read of a
    mode (available or loading and why, its quarantine, its engine and card). The controller keeps those gates'
    verdicts until the count moves (``Controller(standing=...)``), instead of asking every mode at every decision."""

    __slots__ = ("changes",)

    def __init__(self) -> None:
        self.changes = 0

    def __call__(self) -> int:
        return self.changes


#: the :class:`ModeState` fields the standing gates read; setting one counts a change of its registry's standing
STANDING_FIELDS = frozenset({"status", "reason", "engine", "details", "quarantined_until", "last_error"})


@dataclass
class ModeState:
    """A mode as served: its spec, whether it can take requests, its engine worker, and its health.

    A mode that fails a request is quarantined: the controller skips it for a backoff that doubles with
    each consecutive failure (``QUARANTINE_BASE_S`` up to ``QUARANTINE_MAX_S``) and resets on a success.
    The read-only properties are what the controller decides on; they hold for a mode without an engine
    too (not built, or built by hand in a test). Setting a field in :data:`STANDING_FIELDS` counts a change in
    ``standing`` (its registry's: shared by its modes).
    """

    spec: ModeSpec
    standing: Standing = field(default_factory=Standing, repr=False, compare=False)
    status: str = "unavailable"
    reason: str = ""
    engine: Engine | None = None
    details: dict[str, Any] = field(default_factory=dict)
    failures: int = 0
    consecutive_failures: int = 0
    quarantined_until: float = 0.0
    last_error: str = ""
    #: running J per generated token over this mode's completed requests (None until one has finished)
    j_per_token: float | None = None
    #: running watts its completed requests drew while they ran (their joules over their seconds): what a request's
    #: predicted time is priced at by a policy ordering by energy (None until one has finished)
    watts: float | None = None
    energy_requests: int = 0
    #: the running batch it shares with other modes (see BuiltMode.batch); empty: its own
    shared_batch: str = ""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in STANDING_FIELDS:
            self.standing.changes += 1

    def record_failure(self, error: str) -> None:
        self.failures += 1
        self.consecutive_failures += 1
        backoff = min(QUARANTINE_BASE_S * 2 ** (self.consecutive_failures - 1), QUARANTINE_MAX_S)
        self.quarantined_until = time.monotonic() + backoff
        self.last_error = error
        log.warning("mode %s failed (%s); quarantined for %.0f s", self.name, error, backoff)

    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_energy(self, joules: float, generated_tokens: int, seconds: float = 0.0) -> None:
        """Fold a completed request's energy into the mode's running J/token (what the energy gate reads) and, with
        the seconds it took, its running watts."""
        if generated_tokens <= 0:
            return
        self.j_per_token = _running(self.j_per_token, joules / generated_tokens)
        if seconds > 0:
            self.watts = _running(self.watts, joules / seconds)
        self.energy_requests += 1

    @property
    def quarantine_left(self) -> float:
        return max(0.0, self.quarantined_until - time.monotonic())

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def batch(self) -> str:
        return self.shared_batch or self.spec.name

    @property
    def available(self) -> bool:
        return self.status == "available"

    @property
    def loading(self) -> bool:
        """Being built, or its engine being started again: available soon."""
        return self.status in ("loading", "restarting")

    @property
    def down(self) -> bool:
        """It was serving and its engine went down (restarting, or given up): ``/health`` says degraded."""
        return self.engine is not None and self.status in ("restarting", "unavailable")

    def engine_health(self, down: str | None, restarting: bool) -> None:
        """What its engine reports (:meth:`Engine.watch`): down and why (restarting or not), or back up. Back up,
        it serves at once: the requests its dead engine failed quarantined it, and a fresh engine owes nothing
        for them (the requests failed together as it died would keep a restarted mode out of service)."""
        if down is None:
            self.status, self.reason = "available", ""
            self.consecutive_failures, self.quarantined_until = 0, 0.0
        else:
            self.status, self.reason = "restarting" if restarting else "unavailable", down

    @property
    def in_flight(self) -> int:
        return self.engine.in_flight if self.engine is not None else 0

    def load_seconds(self) -> tuple[float, float] | None:
        """Its engine's :meth:`~modeswitch.engines.base.Engine.load_seconds` (None without one)."""
        return self.engine.load_seconds() if self.engine is not None else None

    @property
    def batch_slots(self) -> int:
        """Requests its engine generates at once (1: one at a time, or not loaded)."""
        return self.engine.batch_slots if self.engine is not None else 1

    @property
    def speculative(self) -> bool:
        return self.spec.decoding == "speculative"

    @property
    def max_queue(self) -> int:
        return self.engine.max_queue if self.engine is not None else self.spec.max_queue

    @property
    def capabilities(self) -> frozenset[str]:
        """The request options its engine honours; a mode not loaded yet claims them all (it is filtered as
        loading or unavailable before this is asked)."""
        return self.engine.capabilities if self.engine is not None else OPTIONS

    @property
    def kernels(self) -> dict | None:
        return self.details.get("kernels")

    @property
    def preallocated_kv(self) -> bool:
        """True when a request allocates no new memory (KV reserved at start); an engine-less mode claims
        nothing it would allocate either."""
        return self.engine is None or self.engine.preallocated_kv

    def describe(self, backend: str) -> dict[str, Any]:
        """The mode's ``/v1/modes`` card; ``backend`` names the engine family serving it."""
        spec = self.spec
        quarantined = self.available and self.quarantine_left > 0
        out: dict[str, Any] = {
            "name": spec.name,
            "status": "quarantined" if quarantined else self.status,
            "backend": backend,
            "reason": self.reason,
            "description": spec.description,
            "weights": spec.weights,
            "decoding": spec.decoding,
            "prefix_cache": spec.prefix_cache,
            "batching": spec.batching,
            "max_queue": self.max_queue,
            "in_flight": self.in_flight,
            **self.details,
        }
        if self.j_per_token is not None:
            out["energy"] = {"j_per_token": round(self.j_per_token, 6), "requests": self.energy_requests,
                             **({"watts": round(self.watts, 3)} if self.watts is not None else {})}
        if self.failures:
            out["health"] = {"failures": self.failures, "last_error": self.last_error,
                             "quarantine_left_s": round(self.quarantine_left, 1)}
        if self.engine is not None:
            out["honours"] = sorted(self.engine.capabilities)
            out["stats"] = self.engine.stats()
        return out


class ModeRegistry:
    """Plans memory, has the backend build one engine per mode, warms each up, and keeps each mode's state.

    ``backend``: the engine family to use (default: the one ``load.backend`` selects); a test passes its own.
    Constructing loads nothing; :meth:`load` does.
    """

    def __init__(self, preset: Preset, modes: list[ModeSpec], load: LoadConfig,
                 backend: Backend | None = None) -> None:
        self.preset = preset
        self.load_config = load
        self.backend = backend if backend is not None else select_backend(preset, load)
        #: counts changes to the modes' standing (see :class:`Standing`)
        self.standing = Standing()
        self.modes: dict[str, ModeState] = {m.name: ModeState(m, self.standing) for m in modes}
        #: NVML where the GPU has the counter, else an estimate at ``power_watts`` (labelled "estimated")
        self.energy = EnergyAccountant(meter_for(device_type(self.backend.device), load.power_watts))
        self.plan: MemoryPlan | None = None
        self.tokenizer = None
        self.context_length = 0
        #: KV bytes per token of one sequence (what a request on a mode without reserved KV allocates)
        self.kv_bytes_per_token = 0
        self.load_seconds: dict[str, float] = {}
        self._closing = threading.Event()

    @property
    def backend_name(self) -> str:
        """The engine family serving every mode (the backend's name)."""
        return self.backend.name

    @property
    def gate_key(self) -> str:
        """What a quality gate report must have been scored on to hold here (see ``Backend.gate_key``)."""
        return self.backend.gate_key

    # ------------------------------------------------------------------ loading
    def _plan_memory(self, progress: Progress) -> MemoryPlan:
        """Open the model, size every mode from the backend's footprints, check the budget.

        Modes whose weights cannot be had are marked unavailable here (with the reason) and cost nothing.
        Raises WeightsNotFound without the reference weights, MemoryBudgetExceeded when the rest does not fit.
        """
        info = self.backend.open(progress)
        self.tokenizer, self.context_length = info.tokenizer, info.context_length
        self.kv_bytes_per_token = info.kv_bytes_per_token
        device = self.backend.device
        budget = self.load_config.memory_budget or int(free_memory(device) * (1 - DEFAULT_HEADROOM))
        plan = MemoryPlan(budget=budget, weights={})
        if device_type(device) == "cpu":  # the models live in the memory of this process and its children
            plan.server_bytes = process_tree_memory()["pss_bytes"]
        for state in self.modes.values():
            try:
                plan.add(self.backend.footprint(state.spec))
            except VariantUnavailable as exc:
                state.status, state.reason = "unavailable", str(exc)
        progress(f"memory plan ({device}):\n{plan.describe()}")
        plan.check()
        self.plan = plan
        return plan

    def load(self, progress: Progress = log.info, first: Sequence[str] = ()) -> list[ModeState]:
        """Plan, then build and warm up the modes: all of them, or with ``first`` (modes in order of
        preference: what the policy sends a plain request to) only the first of them that could be planned
        and the modes sharing its weights. The others are left ``loading`` and returned, for
        :meth:`load_rest`; none are when no mode of ``first`` comes up (then everything loads here).

        Raises only when the reference weights are missing or the plan exceeds the budget; any other
        failure makes just that mode unavailable.
        """
        plan = self._plan_memory(progress)
        planned = [state for state in self.modes.values() if not state.reason]
        for state in self.modes.values():
            if state.reason:  # found unavailable while planning
                progress(f"mode {state.name}: unavailable ({state.reason})")
        lead = next((name for name in first if name in self.modes and not self.modes[name].reason), None)
        if lead is None:
            self._build_all(planned, plan, progress)
            return []
        holder = {f.mode: f.weights for f in plan.footprints}
        now = [s for s in planned if holder[s.name] == holder[lead]]
        later = [s for s in planned if s not in now]
        for state in later:
            state.status = "loading"
        self._build_all(now, plan, progress)
        if not any(state.available for state in now):
            self._build_all(later, plan, progress)
            return []
        return later

    def load_rest(self, states: list[ModeState], progress: Progress = log.info,
                  then: Callable[[], None] = lambda: None) -> threading.Thread:
        """Build ``states`` (what :meth:`load` left loading) on a background thread while the others serve,
        then call ``then`` (the controller re-reads which modes share a batch)."""
        def run() -> None:
            started = time.perf_counter()
            self._build_all(states, self.plan, progress)
            then()
            progress(f"all modes loaded, {time.perf_counter() - started:.0f} s after the first served:\n{self.table()}")

        thread = threading.Thread(target=run, name="load-rest", daemon=True)
        thread.start()
        return thread

    def _build_all(self, states: list[ModeState], plan: MemoryPlan, progress: Progress) -> None:
        for state in states:
            if self._closing.is_set():  # shut down while a staged start was loading: start nothing more
                state.status, state.reason = "unavailable", "the server shut down before it loaded"
                continue
            started = time.perf_counter()
            try:
                built = self.backend.build(state.spec, plan, progress)
            except VariantUnavailable as exc:
                state.status, state.reason = "unavailable", str(exc)
            except Exception as exc:  # a mode that cannot be built is listed, never fatal
                log.exception("mode %s could not be built", state.name)
                state.status, state.reason = "unavailable", f"failed to start: {exc}"
            else:
                state.details = built.details  # the backend may update it (vLLM: decode once compiled)
                if why := mismatch(state.spec.weights, built.details.get("kernels")):
                    built.engine.close()  # never served under a name its kernels do not bear out
                    state.status, state.reason = "unavailable", why
                else:
                    state.engine, state.shared_batch = built.engine, built.batch or ""
                    if built.cost is not None:
                        built.engine.attach_energy(self.energy, built.cost)
                    self._warm_up(state)
            self.load_seconds[f"mode:{state.name}"] = time.perf_counter() - started
            progress(f"mode {state.name}: {state.status}{' (' + state.reason + ')' if state.reason else ''}")

    def _warm_up(self, state: ModeState) -> None:
        """Run one short request through the mode's real path; a mode that fails it is marked unavailable."""
        req = GenRequest(prompt_ids=self.tokenizer("Hello").input_ids or [0], params=SamplingParams(max_tokens=2))
        try:
            state.engine.submit(req)
            while True:
                event = req.events.get(timeout=WARM_UP_TIMEOUT_S)
                if event.kind == "error":
                    raise RuntimeError(event.info.get("error"))
                if event.kind == "done":
                    break
            state.engine.watch(state.engine_health)
            state.status = "available"  # last: a mode serves once its state is complete
        except (queue.Empty, RuntimeError) as exc:
            state.engine.close()
            state.status, state.reason, state.engine = "unavailable", f"failed warm-up: {exc or 'timeout'}", None

    # ------------------------------------------------------------------ queries
    @property
    def closing(self) -> bool:
        """The server is shutting down: start nothing more on the engines."""
        return self._closing.is_set()

    def available(self) -> list[ModeState]:
        return [m for m in self.modes.values() if m.available]

    def loading(self) -> list[ModeState]:
        return [m for m in self.modes.values() if m.loading]

    def prefix_matches(self, prompt_ids: list[int]) -> dict[str, int]:
        """Per mode that reads a prefix cache, the leading prompt tokens it would reuse (the controller's feature)."""
        matches = {}
        for name, state in self.modes.items():
            if state.engine is not None and (held := state.engine.prefix_match(prompt_ids)) is not None:
                matches[name] = held
        return matches

    def prefix_capacity_tokens(self) -> int:
        """The most tokens one mode's prefix cache can keep (a transformers prefix store's bound, or a vLLM
        engine's KV pool, whose free blocks hold its prefix cache); 0 when no mode reads a prefix cache."""
        best = 0
        for state in self.modes.values():
            if state.engine is None or state.engine.prefix_match([]) is None:
                continue
            capacity = state.engine.stats().get("prefix_capacity_tokens")
            if capacity is None and (use := state.engine.kv_use()) is not None:
                capacity = use.capacity
            best = max(best, capacity or 0)
        return best

    def memory(self) -> dict[str, Any]:
        """Planned and measured memory: weights per holder in this process (once), KV per mode, the budget."""
        measured = self.backend.resident_weights()
        plan = self.plan
        tree = process_tree_memory() if device_type(self.backend.device) == "cpu" else None
        out = {"budget_bytes": plan.budget if plan else None, "planned_total_bytes": plan.total if plan else None,
               "weights_bytes": measured, "weights_total_bytes": sum(measured.values()),
               "kv_reserved_bytes": plan.kv_total if plan else 0,
               "runtime_bytes": {**plan.runtime, "server": plan.server_bytes} if plan else {}}
        if tree is not None:  # on a CPU the models live in the process tree's memory: what it holds, against the plan
            out["process_tree"] = tree
            if plan and tree["pss_bytes"]:
                out["planned_over_measured"] = round(plan.total / tree["pss_bytes"], 3)
        return out

    def startup_seconds(self) -> dict[str, float]:
        """Start-up time: what the backend loaded or started (weights, engines), and each mode's build and warm-up."""
        return {k: round(t, 2) for k, t in {**self.backend.startup_seconds(), **self.load_seconds}.items()}

    def describe(self) -> list[dict[str, Any]]:
        """Every mode's ``/v1/modes`` card, with its planned memory (and measured weights where held here)."""
        measured = self.backend.resident_weights()
        out = []
        for state in self.modes.values():
            d = state.describe(self.backend.name)
            if "energy" in d:
                d["energy"]["source"] = self.energy.source
            if self.plan is not None and state.available:
                d["memory"] = self.plan.mode_bytes(state.name)
                if d["memory"]["weights_variant"] in measured:
                    d["memory"]["weights_bytes"] = measured[d["memory"]["weights_variant"]]
            out.append(d)
        return out

    def table(self) -> str:
        """Every mode on one line, for the start-up log: its engine, what it computes in and on, its planned
        memory (weights and KV reservation; shared with the modes on the same engine or weights), its status."""
        rows = [("mode", "engine", "compute", "weights", "planned", "status")]
        for card in self.describe():
            kernels, memory = card.get("kernels") or {}, card.get("memory") or {}
            planned = memory.get("weights_bytes", 0) + memory.get("kv_bytes", 0)
            status = card["status"] + (f": {card['reason'][:80]}" if card.get("reason") else "")
            rows.append((card["name"], kernels.get("engine", card.get("backend", "")), kernels.get("compute", ""),
                         kernels.get("weights", ""), fmt(planned) if planned else "", status))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                         for row in rows)

    def engines(self) -> dict[str, Any]:
        """The backend's own state (vLLM: per engine its modes, start time, resident memory, steps)."""
        return self.backend.describe()

    def close(self) -> None:
        self._closing.set()
        for state in self.modes.values():
            if state.engine is not None:
                state.engine.close()
        self.backend.close()
