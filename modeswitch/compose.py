"""The composition root: the one place where a :class:`~modeswitch.config.ServerConfig` becomes running parts.

``serve.py``, the lm-eval adapter, the benchmarks and the tests all assemble a server here, so there is one
order of construction (modes, policy, weights and engines, controller and gate, service, HTTP app) and one
place that knows which concrete classes play each part.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .backends.base import Backend, Progress
from .config import NO_GATE, ServerConfig
from .controller.costs import CALIBRATED_LOADS, CostModel, Measured
from .controller.decide import Controller
from .controller.gates import quality_verdict
from .controller.load import load_policy
from .controller.policy import Policy
from .controller.quality import read_report
from .device import machine
from .memory import MemoryBudgetExceeded
from .modes import WEIGHTS, ModeSpec, load_modes, own_engine_on, own_engine_on_each
from .resources import DEFAULT_POLICY, EXTRA_MODES_DIR, MODES_DIR, POLICIES_DIR, REPORTS_DIR, shipped_report
from .serving.admission import Admission
from .serving.calibrate import Calibration
from .serving.registry import ModeRegistry
from .serving.service import Service
from .weights.presets import cache_dir, resolve_preset
from .yamlconf import ConfigError

log = logging.getLogger("modeswitch")


def mode_specs(config: ServerConfig) -> tuple[list[ModeSpec], list[str]]:
    """The modes to load (``config.modes``, default all) and the names of every defined mode (a policy may
    name a mode that is defined but not loaded)."""
    modes = load_modes(*(config.modes_dirs or (MODES_DIR,)))
    defined = [m.name for m in modes]
    unknown = sorted(set(config.modes) - set(defined))
    if unknown:
        raise ConfigError(f"--modes: unknown mode(s) {', '.join(unknown)}; defined: {', '.join(defined)}")
    return ([m for m in modes if m.name in config.modes] if config.modes else modes), defined


def follow_measurements(specs: list[ModeSpec], costs: CostModel, model: str, progress: Progress) -> list[ModeSpec]:
    """The engine layout where the measurements of an earlier run here choose it: a mode's engine of its own
    (the second engine a burst spreads over, on cores of its own) goes to the weights whose vLLM engine measured
    the fastest step on this machine. With nothing measured yet, the weights of each mode that decodes the same
    way get one too (the first start measures them all; the next keeps the fastest's)."""
    steps = costs.step_by_weights(machine(), model, "vllm", WEIGHTS)
    if not steps:
        hedged, given = own_engine_on_each(specs)
        if given:
            progress(f"engine layout: nothing measured here yet: an engine of its own for {', '.join(given)} too, "
                     f"where the CPU has cores for one (the next start keeps only the fastest weights')")
        return hedged
    fastest = next(iter(steps))
    specs, moved = own_engine_on(specs, fastest)
    if moved:
        progress(f"engine layout: an engine of its own for {'; '.join(moved)}: {fastest} weights step fastest "
                 f"here ({_steps(steps)})")
    return specs


def lead_by_measurement(first: Sequence[str], specs: Sequence[ModeSpec], steps: Mapping[str, Measured],
                        passes: Callable[[str, Mapping | None], bool], progress: Progress) -> tuple[str, ...]:
    """``first`` (the policy's modes for a plain request) with its first mode on the weights an earlier run here
    measured stepping fastest (``steps``, fastest first) moved to the front, where ``passes(mode, card)`` (the
    quality gate, on the kernels that engine was measured with) and the list's own first weights were measured
    too. A staged start serves from the first mode's engine alone until the others are up: it should be the one
    the measurements would send those requests to, not the reference weights a list names first for a machine
    that measured nothing yet."""
    weights = {spec.name: spec.weights for spec in specs}
    listed = next((weights[name] for name in first if name in weights), None)
    if listed not in steps:
        return tuple(first)
    for kind, measured in steps.items():
        if kind == listed:
            break
        lead = next((name for name in first if weights.get(name) == kind and passes(name, measured.kernels)), None)
        if lead is not None:
            progress(f"staged start: {lead} first: {kind} weights step fastest here ({_steps(steps)}), and the "
                     f"quality gate passes {lead} on the kernels measured")
            return (lead, *(name for name in first if name != lead))
    return tuple(first)


def _steps(steps: Mapping[str, Measured]) -> str:
    measured = ", ".join(f"{w} {m.step_s * 1e3:.0f} ms" for w, m in steps.items())
    loads = f"{CALIBRATED_LOADS[0]}-{CALIBRATED_LOADS[-1]}"
    return f"{measured} a step, the mean over {loads} requests, measured by an earlier run"


def staged_first(config: ServerConfig, policy: Policy, backend: str, specs: Sequence[ModeSpec], costs: CostModel,
                 model: str, report: dict | None, progress: Progress) -> tuple[str, ...]:
    """The modes a staged start picks its first engine from, in order (none: every engine starts before serving).
    Where the policy orders by measurement, the weights measured fastest here lead (:func:`lead_by_measurement`),
    as the gate ``report`` (None: the gate is off) judges them. ``backend``: the registry's engine family."""
    if not config.load.staged:
        return ()
    if not policy.orders_by_measurement:
        return policy.first_modes
    steps = costs.step_by_weights(machine(), model, backend.split("+")[0], WEIGHTS)
    return lead_by_measurement(policy.first_modes, specs, steps, lambda mode, card: quality_verdict(
        report, policy.quality, "general", mode, card) is None, progress)


def all_shipped_modes() -> list[ModeSpec]:
    """The reference modes and the extra (speculative) variants shipped with the package."""
    return load_modes(MODES_DIR, EXTRA_MODES_DIR)


def gate_report_path(config: ServerConfig, engine: str) -> Path | None:
    """The report the quality gate enforces: the configured one, else the one shipped for this model scored on
    the kernels serving it (``engine``: the backend's ``gate_key``), if it exists; None when the gate is off."""
    if config.gate_report == NO_GATE:
        return None
    if config.gate_report:
        return Path(config.gate_report)
    shipped = shipped_report(config.model, engine)
    return shipped if shipped.is_file() else None


def build_service(config: ServerConfig, progress: Progress = log.info, *, specs: Sequence[ModeSpec] | None = None,
                  policy=None, backend: Backend | None = None) -> Service:
    """Everything but HTTP; raises WeightsNotFound / ConfigError / MemoryBudgetExceeded with a clear message.
    ``specs`` and ``policy`` replace the configured modes and policy (the lm-eval adapter serves one mode
    it was handed, pinned); ``backend`` replaces the engine family ``config.load.backend`` selects (tests)."""
    if specs is None:
        specs, defined = mode_specs(config)
    else:
        defined = [s.name for s in specs]
    policy = policy or load_policy(config.policy or DEFAULT_POLICY, defined)
    preset = resolve_preset(config.model)
    if config.gptq:
        preset = dataclasses.replace(preset, gptq=config.gptq)
    if config.w8a8:
        preset = dataclasses.replace(preset, w8a8=config.w8a8)
    costs = CostModel(config.costs_file or cache_dir() / "costs.json")
    costs.remeasure_idle_s = config.remeasure_idle_s or math.inf
    laid_out = follow_measurements(list(specs), costs, preset.name, progress) if config.calibrate else list(specs)
    registry = ModeRegistry(preset, laid_out, config.load, backend=backend)
    gate_cache = None if config.gate_report else cache_dir() / "gate"  # a report given by path is enforced as it is
    report_path = gate_report_path(config, registry.gate_key)
    report = read_report(report_path, gate_cache) if report_path is not None else None
    first = staged_first(config, policy, registry.backend_name, laid_out, costs, preset.name, report, progress)
    try:
        later = registry.load(progress, first)
    except MemoryBudgetExceeded:
        if sum(s.own_engine for s in laid_out) <= sum(s.own_engine for s in specs):
            raise
        # the engines a first start adds, to measure every weights', are not worth refusing to start over
        progress("engine layout: the mode files' after all: an engine of its own for every weights exceeds the memory "
                 "budget (the plan above)")
        if backend is None:
            registry.backend.close()
        registry = ModeRegistry(preset, list(specs), config.load, backend=backend)
        later = registry.load(progress, first)
    if not later:
        progress(f"modes:\n{registry.table()}")
    progress(f"energy: {registry.energy.source} ({registry.energy.meter.name})")
    controller = Controller(registry.modes, policy, registry.kv_bytes_per_token, defined_modes=defined, costs=costs,
                            standing=registry.standing)
    if report_path is not None:
        controller.quality_cache = gate_cache  # the shipped report's, with the runs this machine scored itself
        controller.load_quality_report(report_path, read=report)
        progress(f"quality gate: enforcing {report_path}")
    service = Service(registry, controller, preset.name)

    def modes_up() -> None:  # every mode loaded: the service rebinds, then each engine measures its costs
        service.rebind()
        if config.calibrate:
            Calibration(registry, costs, service.rebind, progress).start()

    if later and not gate_passed(controller):
        # the first engine's kernels are not those its gate verdict was measured on: serving from it alone would
        # refuse every request until the others are up
        progress(f"staged start: no mode up passes the quality gate on the kernels it serves with here: loading "
                 f"{', '.join(s.name for s in later)} before serving")
        registry.load_rest(later, progress, then=modes_up).join()
    elif later:
        progress(f"staged start: loading {', '.join(s.name for s in later)} in the background")
        registry.load_rest(later, progress, then=modes_up)
    else:
        modes_up()
    return service


def gate_passed(controller: Controller) -> list[str]:
    """The modes up that the quality gate passes for a plain request, on the kernels they serve with."""
    return [name for name, mode in controller.modes.items() if mode.available and quality_verdict(
        controller.quality_report, controller.policy.quality, "general", name, mode.kernels) is None]


@dataclass
class Server:
    """An assembled server: the service, admission control and the WSGI app over them."""

    config: ServerConfig
    service: Service
    admission: Admission
    app: Any  # the Flask app

    def close(self) -> None:
        self.service.controller.close()
        self.service.registry.close()


def build_app(config: ServerConfig, progress: Progress = log.info, backend: Backend | None = None) -> Server:
    """The whole server for ``config``, ready to be served by any WSGI server (or Flask's test client)."""
    # The HTTP layer is imported here, not at the top: vLLM's engine processes re-import the main module
    # (serve.py, and so this one) and then scan every loaded module's globals, which Flask's request/app
    # proxies break. Only the process that serves HTTP loads Flask.
    from .api.app import create_app
    from .api.context import ApiContext

    service = build_service(config, progress, backend=backend)
    admission = Admission(per_client=config.http.max_inflight_per_client)
    extra = [Path(d).resolve() for d in config.admin_dirs]
    policy_dirs = tuple(dict.fromkeys([Path(service.controller.policy.source).parent.resolve(), POLICIES_DIR, *extra]))
    report = service.controller.quality_report_path
    report_dirs = tuple(dict.fromkeys([*([Path(report).parent.resolve()] if report else []), REPORTS_DIR, *extra]))
    context = ApiContext(service, admission, config.http, policy_dirs, report_dirs)
    if context.admin_exposed and not config.http.unauthenticated_admin:
        progress(f"admin routes closed: listening on {config.http.host} without --api-key")
    return Server(config, service, admission, create_app(context))
