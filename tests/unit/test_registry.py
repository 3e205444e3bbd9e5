"""The mode registry against a backend that needs no weights: it plans, builds, warms up and reports through
the Backend protocol alone, and a mode that cannot be had, built or warmed up is listed with its reason."""

from __future__ import annotations

import threading

import pytest

from modeswitch.backends.base import BuiltMode, KernelUnavailable, ModelInfo
from modeswitch.backends.fallback import FallbackBackend
from modeswitch.backends.starts import StartHistory
from modeswitch.config import LoadConfig
from modeswitch.engines.base import Engine, GenRequest
from modeswitch.sampling_params import OPTIONS, SamplingParams
from modeswitch.memory import Footprint, MemoryBudgetExceeded, MemoryPlan
from modeswitch.weights.presets import PRESETS
from modeswitch.modes import ModeSpec
from modeswitch.serving.registry import ModeRegistry, ModeState
from modeswitch.weights.store import VariantUnavailable

GIB = 2**30


class _Tokenizer:
    def __call__(self, text: str):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()


class _EchoEngine(Engine):
    """Generates the prompt's first tokens back; ``fail`` makes it fail every request (warm-up included)."""

    def __init__(self, max_queue: int, fail: bool = False, reuses: int | None = None) -> None:
        super().__init__(max_queue)
        self.fail, self.reuses = fail, reuses
        self.closed = threading.Event()

    def _enqueue(self, req: GenRequest) -> None:
        if self.fail:
            req.emit("error", error="RuntimeError: broken")
            return
        req.emit("tokens", req.prompt_ids[: req.params.max_tokens])
        req.emit("done", finish_reason="length", cached_tokens=0)

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        return self.reuses

    def close(self) -> None:
        self.closed.set()


class _Backend:
    """Every mode on its own 1 GiB of weights and 1 MiB of KV; what to refuse is set per mode name."""

    name = gate_key = "stub"
    device = "cpu"

    def __init__(self, missing=(), broken=(), failing=(), no_kernel=(), name: str = "stub") -> None:
        """``no_kernel``: modes whose weights this family has no kernel for (another family may serve them)."""
        self.missing, self.broken, self.failing = set(missing), set(broken), set(failing)
        self.no_kernel, self.name = set(no_kernel), name
        self.closed = False

    def open(self, progress) -> ModelInfo:
        return ModelInfo(_Tokenizer(), context_length=2048, kv_bytes_per_token=1024)

    def footprint(self, spec: ModeSpec) -> Footprint:
        if spec.name in self.missing:
            raise VariantUnavailable(f"no {spec.weights} checkpoint here")
        if spec.name in self.no_kernel:
            raise KernelUnavailable(f"no {spec.weights} matmul in {self.name}")
        return Footprint(spec.name, spec.weights, 2**20, "stub KV", {spec.weights: GIB})

    def build(self, spec: ModeSpec, plan, progress) -> BuiltMode:
        if spec.name in self.broken:
            raise RuntimeError("engine would not start")
        engine = _EchoEngine(spec.max_queue, fail=spec.name in self.failing,
                             reuses=7 if spec.prefix_cache else None)
        return BuiltMode(engine, {"built_by": self.name})

    def resident_weights(self) -> dict[str, int]:
        return {"fp16": GIB}

    def startup_seconds(self) -> dict[str, float]:
        return {f"{self.name}:start": 0.5}

    def describe(self) -> dict:
        return {self.name: {"engines": 1}}

    def close(self) -> None:
        self.closed = True


MODES = [ModeSpec("fp16", "fp16"), ModeSpec("prefix_cache", "fp16", prefix_cache=True),
         ModeSpec("gptq", "gptq"), ModeSpec("int8", "int8"), ModeSpec("broken_warm_up", "fp16")]


def registry(backend: _Backend, budget: int = 8 * GIB) -> ModeRegistry:
    reg = ModeRegistry(PRESETS["demo"], MODES, LoadConfig(memory_budget=budget), backend=backend)
    reg.load(progress=lambda line: None)
    return reg


def test_modes_are_built_through_any_backend_and_unservable_ones_keep_their_reason():
    backend = _Backend(missing={"gptq"}, broken={"int8"}, failing={"broken_warm_up"})
    reg = registry(backend)
    assert reg.backend_name == "stub" and reg.context_length == 2048 and reg.kv_bytes_per_token == 1024
    assert [m.name for m in reg.available()] == ["fp16", "prefix_cache"]
    assert reg.modes["gptq"].reason == "no gptq checkpoint here"
    assert reg.modes["int8"].reason == "failed to start: engine would not start"
    assert reg.modes["broken_warm_up"].reason == "failed warm-up: RuntimeError: broken"
    assert reg.modes["broken_warm_up"].engine is None
    # the plan counts what the backend planned (gptq had nothing to plan), weights once per holder
    assert reg.plan.weights == {"fp16": GIB, "int8": GIB} and len(reg.plan.footprints) == 4
    cards = {c["name"]: c for c in reg.describe()}
    assert cards["fp16"]["backend"] == "stub" and cards["fp16"]["built_by"] == "stub"
    assert cards["fp16"]["memory"]["weights_shared_with"] == ["prefix_cache", "broken_warm_up"]
    assert cards["fp16"]["stats"] == {} and "memory" not in cards["gptq"]
    assert reg.memory()["weights_bytes"] == {"fp16": GIB} and reg.engines() == {"stub": {"engines": 1}}
    assert reg.startup_seconds()["stub:start"] == 0.5 and "mode:fp16" in reg.startup_seconds()
    reg.close()
    assert backend.closed and reg.modes["fp16"].engine.closed.is_set()


def test_a_mode_its_backend_has_no_kernel_for_is_served_by_the_fallback_in_the_same_pool():
    """``--backend auto``'s composition: the primary serves what it has kernels for, the fallback the rest, in one
    plan (the fallback's holders named after it, so an in-process copy of weights is never taken for the primary's
    engine of the same variant); each card says which family serves it and why; a mode neither can serve keeps both
    reasons; closing closes both."""
    primary = _Backend(no_kernel={"gptq", "int8"}, name="engines")
    fallback = _Backend(missing={"int8"}, name="inproc")
    backend = FallbackBackend(primary, fallback)
    reg = registry(backend)
    assert [m.name for m in reg.available()] == ["fp16", "prefix_cache", "gptq", "broken_warm_up"]
    assert reg.backend_name == "engines+inproc" and reg.gate_key == "stub"
    assert reg.modes["int8"].reason == "no int8 matmul in engines; inproc: no int8 checkpoint here"
    assert reg.plan.weights == {"fp16": GIB, "inproc:gptq": GIB}
    cards = {c["name"]: c for c in reg.describe()}
    assert (cards["fp16"]["backend"], cards["fp16"]["built_by"]) == ("engines", "engines")
    assert (cards["gptq"]["backend"], cards["gptq"]["built_by"]) == ("inproc", "inproc")
    assert cards["gptq"]["backend_reason"] == "engines: no gptq matmul in engines"
    assert "backend_reason" not in cards["fp16"] and cards["gptq"]["memory"]["weights_variant"] == "inproc:gptq"
    assert reg.memory()["weights_bytes"] == {"fp16": GIB, "inproc:fp16": GIB}
    assert reg.engines() == {"engines": {"engines": 1}, "inproc:inproc": {"engines": 1}}
    assert {"engines:start", "inproc:inproc:start"} <= set(reg.startup_seconds())
    reg.close()
    assert primary.closed and fallback.closed


def test_prefix_matches_come_from_the_modes_that_read_a_prefix_cache():
    reg = registry(_Backend())
    assert reg.prefix_matches([1, 2, 3]) == {"prefix_cache": 7}


def test_mode_state_is_what_the_controller_reads():
    reg = registry(_Backend())
    state = reg.modes["fp16"]
    req = GenRequest([1, 2, 3], SamplingParams(max_tokens=2))
    state.engine.submit(req)
    assert req.events.get(timeout=5).token_ids == (1, 2)
    assert (state.available, state.reason, state.in_flight, state.max_queue) == (True, "", 0, 8)
    assert (state.capabilities, state.preallocated_kv) == (OPTIONS, False)
    assert state.quarantine_left == 0 and state.last_error == "" and state.j_per_token is None
    state.record_failure("boom")
    assert state.quarantine_left > 0 and state.last_error == "boom"
    state.record_energy(2.0, 4, 0.5)
    assert state.j_per_token == 0.5 and state.watts == 4.0
    state.record_energy(1.0, 4, 1.0)  # each a running mean: 0.2 of the way to the new request's
    assert state.j_per_token == pytest.approx(0.45) and state.watts == pytest.approx(3.4)
    reg.close()


def test_a_plan_over_the_budget_is_refused_before_anything_is_built():
    backend = _Backend()
    with pytest.raises(MemoryBudgetExceeded, match="load fewer modes"):
        registry(backend, budget=GIB)
    assert not backend.closed


def test_a_staged_load_builds_the_first_modes_weights_now_and_the_rest_in_the_background():
    backend = _Backend(missing={"gptq"})
    reg = ModeRegistry(PRESETS["demo"], MODES, LoadConfig(memory_budget=8 * GIB), backend=backend)
    release, done = threading.Event(), threading.Event()
    build = backend.build
    backend.build = lambda spec, plan, progress: (release.wait(), build(spec, plan, progress))[1]
    release.set()  # the first stage builds at once
    # gptq (first preference) could not be planned: prefix_cache leads, with every mode on its weights
    later = reg.load(lambda line: None, first=("gptq", "prefix_cache", "int8"))
    assert [s.name for s in later] == ["int8"]
    assert [m.name for m in reg.available()] == ["fp16", "prefix_cache", "broken_warm_up"]
    assert reg.modes["int8"].loading and not reg.modes["int8"].available and reg.modes["gptq"].reason
    release.clear()
    thread = reg.load_rest(later, lambda line: None, then=done.set)
    assert not done.wait(0.2) and [m.name for m in reg.loading()] == ["int8"]
    release.set()
    thread.join(5)
    assert done.is_set() and reg.modes["int8"].available and not reg.loading()
    reg.close()


def test_a_staged_load_whose_first_modes_fail_loads_everything_before_serving():
    reg = ModeRegistry(PRESETS["demo"], MODES, LoadConfig(memory_budget=8 * GIB),
                       backend=_Backend(broken={"gptq"}))
    assert reg.load(lambda line: None, first=("gptq",)) == []
    assert [m.name for m in reg.available()] == ["fp16", "prefix_cache", "int8", "broken_warm_up"] and not reg.loading()
    reg.close()


def test_a_shared_kv_pool_holds_its_largest_reservation_and_runtimes_count_once():
    """Modes on one engine share its KV pool (it holds the largest of their reservations, not their sum); an
    engine's runtime counts once however many modes it serves; what the server already holds is in the total,
    not in what the budget must still fit."""
    plan = MemoryPlan(budget=10 * GIB, weights={}, server_bytes=GIB)
    plan.add(Footprint("fp16", "e1", GIB, "one sequence", {"e1": GIB}, kv_pool="e1", runtime_bytes={"e1": GIB}))
    plan.add(Footprint("prefix_cache", "e1", 2 * GIB, "one sequence + prefixes", {"e1": GIB}, kv_pool="e1",
                       runtime_bytes={"e1": GIB}))
    plan.add(Footprint("gptq", "gptq", GIB, "one sequence", {"gptq": GIB}))  # a pool of its own
    assert plan.pools == {"e1": 2 * GIB, "gptq": GIB} and plan.kv_total == 3 * GIB
    assert plan.holder_bytes("e1") == 4 * GIB  # weights, pool, runtime
    assert plan.total == 2 * GIB + 3 * GIB + GIB + GIB and plan.to_load == plan.total - GIB
    plan.check()
    assert plan.mode_bytes("prefix_cache")["kv_pool"] == "e1" and "kv_pool" not in plan.mode_bytes("gptq")
    assert "in the pool of e1 (2.00 GiB)" in plan.describe() and "runtime e1: 1.00 GiB" in plan.describe()
    plan.budget = 5 * GIB
    with pytest.raises(MemoryBudgetExceeded, match="need 6.00 GiB but the memory budget is 5.00 GiB"):
        plan.check()


def test_the_start_up_table_lists_every_mode_with_its_engine_memory_and_status():
    reg = registry(_Backend(missing={"gptq"}, broken={"int8"}, failing={"broken_warm_up"}))
    rows = {line.split()[0]: line for line in reg.table().splitlines()[1:]}
    assert set(rows) == {m.name for m in MODES}
    assert rows["fp16"].rstrip().endswith("available") and "GiB" in rows["fp16"]
    assert rows["gptq"].rstrip().endswith("unavailable: no gptq checkpoint here")
    assert "unavailable: failed to start: engine would not start" in rows["int8"]


def test_start_history_keeps_each_engines_last_start_across_servers(tmp_path):
    path = tmp_path / "starts.json"
    first = StartHistory(path)
    assert first.last("demo:fp16:compiled") is None
    first.record("demo:fp16:compiled", 61.26)
    first.record("demo:gptq:compiled", 80)
    assert StartHistory(path).last("demo:fp16:compiled") == 61.3  # what the next server reads
    path.write_text("{not json")
    assert StartHistory(path).last("demo:fp16:compiled") is None  # a courtesy: a bad file is an empty history


def test_a_mode_whose_engine_is_back_up_serves_at_once():
    """The requests an engine's death failed quarantine its mode; the restarted engine clears that."""
    state = ModeState(ModeSpec(name="fp16", weights="fp16"))
    state.status = "available"
    for _ in range(5):
        state.record_failure("vLLM engine fp16 died")
    state.engine_health("vLLM engine fp16 died", restarting=True)
    assert state.status == "restarting" and state.quarantine_left > 60
    state.engine_health(None, restarting=False)
    assert state.available and state.quarantine_left == 0
    state.record_failure("a request failed")  # the backoff starts over
    assert 0 < state.quarantine_left <= 5


def test_the_controller_keeps_the_standing_verdicts_until_a_modes_standing_changes():
    """The gates that read only a mode's standing (available, quarantine, quality on its card) are asked again
    only when the registry counts a change: each change below reaches the very next decision, and decisions with
    nothing changed between them do not ask those gates."""
    from modeswitch.controller.decide import Controller
    from modeswitch.controller.verdicts import Code
    from policy_text import feats, policy_from

    reg = registry(_Backend(broken={"broken_warm_up"}))
    ctl = Controller(reg.modes, policy_from("rules: []\ndefault: [int8, fp16, gptq]\n"), standing=reg.standing)
    asked = []

    class Counting:
        name, standing = "counting", True

        def admit(self, modes, cycle, filtered):
            asked.append(len(modes))
            return modes

    ctl._standing_gates += (Counting(),)
    assert [ctl.decide(feats()).mode for _ in range(3)] == ["int8"] * 3 and len(asked) == 1
    reg.modes["int8"].record_failure("boom")  # quarantined
    assert ctl.decide(feats()).mode == "fp16" and ctl.filter(feats())["int8"].code is Code.QUARANTINED
    reg.modes["int8"].engine_health(None, restarting=False)  # back up: its quarantine lifted
    assert ctl.decide(feats()).mode == "int8"
    reg.modes["int8"].engine_health("engine died", restarting=True)
    assert ctl.decide(feats()).mode == "fp16" and ctl.filter(feats())["int8"].code is Code.LOADING
    reg.modes["int8"].engine_health(None, restarting=False)
    assert ctl.decide(feats()).mode == "int8"
    asked.clear()
    ctl.quality_report = {"tasks": {"ppl": {"higher_is_better": False}},
                          "modes": {"fp16": {"ppl": {"value": 100.0}}, "int8": {"ppl": {"value": 140.0}}}}
    assert [ctl.decide(feats()).mode for _ in range(3)] == ["fp16"] * 3 and len(asked) == 1  # the report read at once
    reg.close()


def test_a_hook_after_release_runs_once_after_the_slot_is_freed_whenever_it_is_given():
    """``GenRequest.after_release``: given before the request ends, it runs after the ``on_finish`` hooks (the
    engine's slot is free by then); given after, it runs at once; given while the engine ends the request on
    another thread, it runs once, never not at all."""
    seen = []
    req = GenRequest([1], SamplingParams(max_tokens=2))
    req.on_finish.append(lambda: seen.append(("slot freed", req.released)))
    req.after_release(lambda: seen.append(("after", req.released)))
    assert seen == []
    req.emit("done", finish_reason="stop")
    req.after_release(lambda: seen.append(("late", req.released)))
    assert seen == [("slot freed", False), ("after", True), ("late", True)]
    for _ in range(300):
        req, runs = GenRequest([1], SamplingParams(max_tokens=2)), []
        ender = threading.Thread(target=req.emit, args=("done",))
        ender.start()
        req.after_release(lambda: runs.append(1))
        ender.join()
        assert runs == [1]
