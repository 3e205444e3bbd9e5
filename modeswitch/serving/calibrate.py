"""Each engine measures what it costs on this machine, once its modes are up, behind the requests it serves.

For every engine stream the cost model has no measurements of (:mod:`modeswitch.controller.costs`; a restart
on the same machine, model and engine configuration reads the last run's from its file instead), a few
requests go straight to one of the stream's modes:

- prefill: one request per prompt length in :data:`PROMPT_TOKENS` (random token ids, so no prefix cache
  holds them), timed to its first token, :data:`ROUNDS` times (the fastest counts);
- step: at each load in ``CALIBRATED_LOADS`` up to what the engine batches, that many requests together, each made
  to generate :data:`TOKENS` tokens (``ignore_eos``), timed per token after the first (their median; the
  fastest of :data:`ROUNDS` such runs counts). A drafting stream's
  requests quote a repeated sequence, so that the drafts are accepted and a step verifies them; its time per
  token is turned into time per target step by the target steps the engine reports.

Streams are measured one at a time (a stream measured beside another would time their contention), each with
live requests beside it as they come: the measurements are corrected by every finished request anyway. A
stream's calibration is measured whole before it replaces the stream's curves. The calibration then looks again
every :data:`RECHECK_S`: an engine that changed (compiled behind the requests, so its key changed) keeps its old
curves until it is measured again under its new key, which waits for a moment its lane is idle (measured beside
live requests, its times would be theirs too). An engine idle by measurement is measured again the same way once
its curves are older than ``CostModel.remeasure_idle_s``: it serves no request that would correct them.
"""

from __future__ import annotations

import logging
import queue
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..controller.costs import CALIBRATED_LOADS, CostModel
from ..controller.curves import StreamCosts
from ..controller.speculation import tokens_per_step
from ..engines.base import GenRequest
from ..sampling_params import SamplingParams
from .registry import ModeRegistry, ModeState

log = logging.getLogger(__name__)

#: prompt lengths whose prefill is timed (the curve is interpolated between them)
PROMPT_TOKENS = (16, 64, 256, 1024)
#: requests run together on an engine to time its step (capped by what it batches)
#: tokens each step-timing request generates
TOKENS = 16
#: times each prompt length and each load is timed; the fastest counts (a machine's noise only adds time: another
#: process on the core, a page fault, a neighbour on a shared host, so one disturbed timing is not the engine's cost)
ROUNDS = 2
#: the longest a calibration request may take before the stream is given up (an engine wedged or far too slow)
REQUEST_TIMEOUT_S = 300.0
#: how often the calibration looks for engines to measure once it has measured every one
RECHECK_S = 30.0


@dataclass
class _Timed:
    """One calibration request's timings, read from its events."""

    submitted: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    target_steps: int | None = None
    error: str = ""


def _run(state: ModeState, prompts: list[list[int]], max_tokens: int) -> list[_Timed]:
    """Submit ``prompts`` together to ``state``'s engine and read each to its end."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [GenRequest(prompt_ids=p, params=params) for p in prompts]
    timed = []
    for req in requests:
        timed.append(_Timed(time.perf_counter()))
        state.engine.submit(req)

    def read(req: GenRequest, t: _Timed) -> None:
        deadline = t.submitted + REQUEST_TIMEOUT_S
        while True:
            try:
                event = req.events.get(timeout=max(deadline - time.perf_counter(), 0.001))
            except queue.Empty:  # no answer by the deadline: cancelled and counted as timed out below
                return
            now = time.perf_counter()
            if event.kind == "tokens":
                t.first = t.first or now
                t.tokens += len(event.token_ids)
            elif event.kind == "error":
                t.error = str(event.info.get("error"))
                return
            elif event.kind == "done":
                t.done = now
                t.target_steps = (event.info.get("speculative") or {}).get("target_steps")
                return

    readers = [threading.Thread(target=read, args=(r, t), daemon=True) for r, t in zip(requests, timed)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(REQUEST_TIMEOUT_S + 1)
    for req, t in zip(requests, timed):
        if t.done is None and not t.error:
            req.cancel()
            t.error = "timed out"
    return timed


class Calibration:
    """Measures every unmeasured stream of the resident modes, on a background thread (:meth:`start`), until the
    server closes. ``rebind``: re-reads the resident modes into the cost model (``Service.rebind``)."""

    def __init__(self, registry: ModeRegistry, costs: CostModel, rebind: Callable[[], None],
                 progress: Callable[[str], None] = log.info, seed: int = 0) -> None:
        self.registry, self.costs, self.rebind, self.progress = registry, costs, rebind, progress
        self._random = random.Random(seed)
        self._vocab = max(len(registry.tokenizer) if registry.tokenizer is not None else 0, 512)
        self.thread: threading.Thread | None = None
        self.measured: list[str] = []

    def start(self) -> threading.Thread:
        self.thread = threading.Thread(target=self.run, name="calibrate", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> None:
        while not self.registry.closing:
            self.rebind()
            self.measure_unmeasured()
            deadline = time.monotonic() + RECHECK_S
            while time.monotonic() < deadline and not self.registry.closing:
                time.sleep(0.2)

    def measure_unmeasured(self) -> list[str]:
        """Measure each stream the cost model has no curves of, and each stale one and each one idle by
        measurement for a while (``CostModel.needs_measuring``) whose lane is quiet; returns those measured."""
        started, measured = time.perf_counter(), []
        for stream, state in self.representatives().items():
            why = self.costs.needs_measuring(stream)
            if why is None or self.registry.closing or (why != "unmeasured" and self._lane_busy(state)):
                continue
            self.costs.calibration = f"measuring {stream}"
            try:
                self.costs.install(stream, self.measure(stream, state))
            except Exception as exc:  # a stream that cannot be measured is left to the live requests
                log.warning("calibrating %s on mode %s failed: %s", stream, state.name, exc)
                continue
            self._report(stream, state)
            measured.append(stream)
        self.measured += measured
        pending = sorted(s for s in set(self.costs.binding.streams.values()) if self.costs.needs_measuring(s))
        self.costs.calibration = "done" + (f"; to measure: {', '.join(pending)}" if pending else "")
        if measured:
            self.costs.save()
            idle = self.costs.idle_by_measurement()
            self.progress(f"costs measured for {', '.join(measured)} in {time.perf_counter() - started:.0f} s"
                          + (f"; slower than another engine at every load: {', '.join(idle)}" if idle else ""))
        return measured

    def _lane_busy(self, state: ModeState) -> bool:
        return self.costs.lane_load(state.name, {n: m.in_flight for n, m in self.registry.modes.items()}) > 0

    def representatives(self) -> dict[str, ModeState]:
        """Per stream, the mode its calibration requests go to: one reading no prefix cache where there is one."""
        streams = self.costs.binding.streams
        out: dict[str, ModeState] = {}
        for name, stream in streams.items():
            state = self.registry.modes.get(name)
            if state is None or not state.available or state.engine is None:
                continue
            if stream not in out or (out[stream].spec.prefix_cache and not state.spec.prefix_cache):
                out[stream] = state
        return out

    def _prompt(self, n: int, repeat: bool = False) -> list[int]:
        """``n`` random token ids (past the first 256, which hold a tokenizer's special and byte tokens), or a
        random 8-token sequence repeated to ``n`` (what n-gram drafting copies from)."""
        draw = lambda k: [self._random.randrange(256, self._vocab) for _ in range(k)]  # noqa: E731
        if not repeat:
            return draw(n)
        unit = draw(8)
        return (unit * (n // 8 + 1))[:n]

    def measure(self, stream: str, state: ModeState) -> StreamCosts:
        """``stream``'s curves, timed on ``state``'s engine."""
        fresh = StreamCosts.empty()
        drafting = state.speculative
        context = self.registry.context_length or 2048
        for n in (n for n in PROMPT_TOKENS if n + 2 <= context):
            fresh.prefill.add(n, min(self._prefill(state, n) for _ in range(ROUNDS)))
        slots = max(state.batch_slots, 1)
        for load in (n for n in CALIBRATED_LOADS if n <= min(slots, state.max_queue)):
            timed = [self._step(state, load, drafting) for _ in range(ROUNDS)]
            joined, seconds = min(timed, key=lambda t: t[1])
            fresh.step.add(load + joined, seconds)
        return fresh

    def _prefill(self, state: ModeState, n: int) -> float:
        """Seconds to the first token of one ``n``-token prompt alone."""
        t = _run(state, [self._prompt(n)], 2)[0]
        if t.error or t.first is None:
            raise RuntimeError(t.error or "no token")
        return t.first - t.submitted

    def _step(self, state: ModeState, load: int, drafting: bool) -> tuple[float, float]:
        """The requests on the engine (``load`` of these and any live ones that joined) and the median seconds per
        (target) step of ``load`` requests run together."""
        timed = _run(state, [self._prompt(32, repeat=drafting) for _ in range(load)], TOKENS)
        joined, _ = self.costs.engine_load(state.name, {n: m.in_flight for n, m in self.registry.modes.items()})
        per_step = []
        for t in timed:
            if t.error or t.first is None or t.done is None or t.tokens < 2:
                continue
            seconds = (t.done - t.first) / (t.tokens - 1)
            if drafting:
                tps = tokens_per_step(t.tokens, t.target_steps)
                if tps is None:
                    continue
                seconds *= tps
            per_step.append(seconds)
        if not per_step:
            raise RuntimeError(f"no timed step at load {load}")
        return joined, statistics.median(per_step)

    def _report(self, stream: str, state: ModeState) -> None:
        curve = self.costs.stream(stream)
        steps = ", ".join(f"{x:g}: {y * 1e3:.1f}" for x, y, _ in curve.step.dump())
        self.progress(f"costs of {stream} (mode {state.name}): ms per step by requests on the engine {steps}; prefill of "
                      f"{PROMPT_TOKENS[0]} tokens {curve.prefill.at(PROMPT_TOKENS[0]) * 1e3:.0f} ms")
