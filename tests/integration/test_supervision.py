"""Supervision of the transformers engines (the demo model, in this process): a worker thread that exits and
a step that runs past ``--engine-stall-s`` take the mode out of the pool, answer its requests, and a new worker
(for continuous batching, a new manager) serves again, the same tokens as before."""

from __future__ import annotations

import threading
import time

import pytest
from transformers import AutoTokenizer

from modeswitch.backends.base import SUPERVISE_S
from modeswitch.config import LoadConfig
from modeswitch.engines.base import GenRequest, SamplingParams
from modeswitch.modes import load_modes
from modeswitch.serving.registry import ModeRegistry
from modeswitch.weights.presets import PRESETS


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


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def registry():
    load = LoadConfig(backend="transformers", device="cpu", dtype="float32", max_model_len=512, engine_stall_s=5.0,
                      staged=False)
    reg = ModeRegistry(PRESETS["demo"], [m for m in load_modes() if m.name == "fp16"], load)
    reg.load(progress=lambda line: None)
    yield reg
    reg.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the crash below is meant
def test_a_dead_or_wedged_worker_is_answered_and_replaced(registry):
    state = registry.modes["fp16"]
    engine = state.engine
    health: list[tuple[str | None, bool]] = []
    engine.watch(lambda down, restarting: health.append((down, restarting)))
    ids = AutoTokenizer.from_pretrained(registry.backend.weights.ref("fp16"))("The capital of France is").input_ids
    kind, expected, _ = outcome(send(engine, ids))
    assert kind == "done" and expected, _

    def crash(req):
        del engine._generate  # the next worker generates as before
        raise WorkerCrash()

    engine._generate = crash
    first, queued = send(engine, ids), send(engine, ids)
    assert [outcome(r)[0] for r in (first, queued)] == ["error", "error"]
    wait_for(lambda: state.available)
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
    assert (engine.counters["engine_deaths"], engine.counters["engine_restarts"]) == (2, 2)
    assert state.describe("transformers")["stats"]["engine_deaths"] == 2


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
        assert (engine.counters["engine_deaths"], engine.counters["engine_restarts"]) == (1, 1)

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
        assert (engine.counters["engine_deaths"], engine.counters["engine_restarts"]) == (2, 2)
        assert state.describe("transformers")["stats"]["engine_restarts"] == 2
    finally:
        reg.close()
