"""Supervision of the transformers engines (the demo model, in this process): a worker thread that exits and
a step that runs past ``--engine-stall-s`` take the mode out of the pool, answer its requests, and a new worker
(for continuous batching, a new manager) serves again, the same tokens as before, as often as it falls; a crash
loop parks the mode until its backoff has passed."""

from __future__ import annotations

import threading
import time

import pytest
from transformers import AutoTokenizer

from modeswitch.backends.base import SUPERVISE_S
from modeswitch.config import LoadConfig
from modeswitch.engines.base import GenRequest
from modeswitch.sampling_params import SamplingParams
from modeswitch.modes import load_modes
from modeswitch.serving.metrics import Metrics
from modeswitch.serving.registry import ModeRegistry
from modeswitch.weights.presets import PRESETS
from waiting import wait_for


class WorkerCrash(BaseException):
    """What no request handler catches: the worker thread exits with it."""


def send(engine, ids: list[int]) -> GenRequest:
    req = GenRequest(prompt_ids=list(ids), params=SamplingParams(max_tokens=8))
    engine.submit(req)
    return req


def outcome(req: GenRequest) -> tuple[str, list[int], dict]:
    tokens: list[int] = []
    while True:
        event = req.events.get(timeout=120)
        if event.kind == "tokens":
            tokens += event.token_ids
        else:
            return event.kind, tokens, event.info


@pytest.fixture(scope="module")
def registry():
    load = LoadConfig(backend="transformers", device="cpu", dtype="float32", max_model_len=512, engine_stall_s=5.0,
                      staged=False)
    reg = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == "fp16"], load)
    reg.load(progress=lambda line: None)
    yield reg
    reg.close()


def crash_next_request(engine) -> None:
    """The engine's worker thread exits, uncaught, at its next request; the worker that replaces it generates as
    before."""

    def crash(req):
        del engine._generate
        raise WorkerCrash()

    engine._generate = crash


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash below is meant
def test_a_dead_or_wedged_worker_is_answered_and_replaced(registry):
    state = registry.modes["fp16"]
    engine = state.engine
    health: list[tuple[str | None, bool]] = []
    engine.watch(lambda down, restarting: health.append((down, restarting)))
    ids = AutoTokenizer.from_pretrained(registry.backend.weights.ref("fp16"))("The capital of France is").input_ids
    kind, expected, _ = outcome(send(engine, ids))
    assert kind == "done" and expected, _

    crash_next_request(engine)
    first, queued = send(engine, ids), send(engine, ids)
    assert [outcome(r)[0] for r in (first, queued)] == ["error", "error"]
    wait_for(lambda: state.available and len(health) >= 2)  # the registry's watcher is told before this test's
    (down, restarting), back = health[:2]
    assert "worker thread exited" in down and restarting and back == (None, False) and engine.in_flight == 0
    assert outcome(send(engine, ids))[:2] == ("done", expected)

    def wedge(req):  # no step for 12 s, then the real generation: by then the worker has been given up on
        del engine._generate
        time.sleep(12)
        engine._generate(req)

    engine._generate = wedge
    stuck = send(engine, ids)
    kind, tokens, info = outcome(stuck)
    assert kind == "error" and tokens == [] and "one step has run" in info["error"]
    assert state.status == "restarting" and "--engine-stall-s 5" in state.reason
    wait_for(lambda: state.available)  # once the wedged thread has left, at its first step
    assert outcome(send(engine, ids))[:2] == ("done", expected)
    stats = state.describe("transformers")["stats"]
    assert (stats["engine_deaths"], stats["engine_restarts"], stats["engine_parks"]) == (2, 2, 0)


def test_a_continuous_batching_manager_that_stops_or_wedges_is_replaced():
    """transformers' manager thread ends on an error in a batch step, or a step runs past ``--engine-stall-s``:
    the requests on it are answered, the mode is ``restarting``, and a new manager serves the same tokens."""
    load = LoadConfig(backend="transformers", device="cpu", dtype="float32", max_model_len=512, engine_stall_s=5.0,
                      staged=False)
    reg = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == "continuous_batching"], load)
    reg.load(progress=lambda line: None)
    try:
        state = reg.modes["continuous_batching"]
        engine = state.engine
        health: list[tuple[str, str | None]] = []  # the mode's status as each report leaves it, and the reason
        engine.watch(lambda down, restarting: health.append((state.status, down)))
        ids = AutoTokenizer.from_pretrained(reg.backend.weights.ref("fp16"))("The capital of France is").input_ids
        kind, expected, _ = outcome(send(engine, ids))
        assert kind == "done" and expected, _
        first = engine.manager

        def broken_step():  # the next manager steps as before
            raise RuntimeError("a batch step failed")

        engine._manager_step = broken_step
        assert [outcome(r)[:2] for r in (send(engine, ids), send(engine, ids))] == [("error", [])] * 2
        wait_for(lambda: len(health) == 2)  # down, then back up
        (status, down), back = health
        assert status == "restarting" and "manager stopped" in down and "a batch step failed" in down
        assert back == ("available", None) and engine.manager is not first and engine.in_flight == 0
        assert outcome(send(engine, ids))[:2] == ("done", expected)
        assert (engine.stats()["engine_deaths"], engine.stats()["engine_restarts"]) == (1, 1)

        second, step, release = engine.manager, engine._manager_step, threading.Event()

        def wedged_step():  # no step until released, long after it has been given up on
            release.wait()
            step()

        engine._manager_step = wedged_step
        kind, tokens, info = outcome(send(engine, ids))
        assert kind == "error" and tokens == [] and "one step has run" in info["error"]
        assert state.status == "restarting" and "--engine-stall-s 5" in state.reason
        time.sleep(3 * SUPERVISE_S)  # no new manager beside the wedged one's thread
        assert state.status == "restarting" and engine.manager is second and second.is_running()
        release.set()  # its thread leaves after this step
        wait_for(lambda: state.available)
        assert not second.is_running() and engine.manager is not second
        assert outcome(send(engine, ids))[:2] == ("done", expected)
        assert (engine.stats()["engine_deaths"], state.describe("transformers")["stats"]["engine_restarts"]) == (2, 2)
    finally:
        reg.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crashes below are meant
def test_an_engine_comes_back_each_time_and_a_crash_loop_is_parked_then_retried():
    """Killed 4 times, the engine comes back 4 times (there is no cap on restarts); the 5th death within the window
    is a crash loop: the mode is ``unavailable`` with the reason and the next start's time in ``/v1/modes`` and
    ``/metrics``, and it serves again, the same tokens, once the backoff has passed."""
    load = LoadConfig(backend="transformers", device="cpu", dtype="float32", max_model_len=512, staged=False,
                      crash_loop_deaths=4, crash_loop_window_s=600, crash_loop_backoff_s=4)
    reg = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == "fp16"], load)
    reg.load(progress=lambda line: None)
    metrics = Metrics(reg, "demo")
    try:
        state = reg.modes["fp16"]
        engine = state.engine
        ids = AutoTokenizer.from_pretrained(reg.backend.weights.ref("fp16"))("The capital of France is").input_ids
        kind, expected, _ = outcome(send(engine, ids))
        assert kind == "done" and expected
        for death in range(1, 5):
            crash_next_request(engine)
            assert outcome(send(engine, ids))[0] == "error"
            wait_for(lambda: state.available)
            assert outcome(send(engine, ids))[:2] == ("done", expected)
            stats = engine.stats()
            assert (stats["engine_deaths"], stats["engine_restarts"], stats["engine_parks"]) == (death, death, 0)

        crash_next_request(engine)
        parked_at = time.monotonic()
        assert outcome(send(engine, ids))[0] == "error"
        card = state.describe("transformers")
        assert card["status"] == "unavailable" and "crash loop: 5 deaths in 600 s (more than 4" in card["reason"]
        assert 0 < card["stats"]["engine_next_retry_s"] <= 4 and card["stats"]["engine_parks"] == 1
        text = metrics.render().decode()
        assert 'modeswitch_engine_crash_loops_total{mode="fp16"} 1.0' in text
        assert 'modeswitch_engine_next_retry_seconds{mode="fp16"}' in text
        time.sleep(2)
        assert state.status == "unavailable"  # not before the backoff
        wait_for(lambda: state.available, timeout=10)
        assert time.monotonic() - parked_at >= 4 - SUPERVISE_S
        assert outcome(send(engine, ids))[:2] == ("done", expected)
        stats = engine.stats()
        assert (stats["engine_deaths"], stats["engine_restarts"]) == (5, 5) and "engine_next_retry_s" not in stats
    finally:
        reg.close()


def test_a_closed_engine_is_not_counted_dead():
    """The registry closes the modes' engines before the backend: a worker that left because its engine was closed
    is no death, and no new worker is started for it."""
    load = LoadConfig(backend="transformers", device="cpu", dtype="float32", max_model_len=512, staged=False)
    reg = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == "fp16"], load)
    reg.load(progress=lambda line: None)
    try:
        engine = reg.modes["fp16"].engine
        engine.close()
        time.sleep(3 * SUPERVISE_S)
        assert engine.stats()["engine_deaths"] == 0 and not engine._worker.is_alive()
    finally:
        reg.close()
