"""What a request goes through between HTTP and an engine: features, decision, submission, text.

:class:`Service` is the only place that knows both the controller and the engines. It turns a tokenized
prompt into a :class:`Generation`, which yields text deltas (incremental detokenization, stop strings)
and ends with the finish reason, token counts, timings and the decision that chose the mode.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Iterator, Mapping

from ..controller.completed import Completed
from ..controller.decide import Controller, NoEligibleMode
from ..controller.features import Features
from ..controller.costs import Binding, stream_key
from ..controller.speculation import REPLAY_K, SpeculationModel
from ..controller.verdicts import Code
from ..device import machine, memory_headroom
from ..engines.base import Event, GenRequest, QueueFull, TokenLogprobs
from ..sampling_params import SamplingParams
from .metrics import Metrics
from .registry import ModeRegistry

log = logging.getLogger(__name__)

#: How long a request waits for its engine's next event before it is answered with an error.
EVENT_TIMEOUT_S = 600.0


class GenerationError(RuntimeError):
    """The engine failed the request."""


class TextAssembler:
    """Incremental detokenization with stop strings.

    Decoding the whole sequence each time keeps multi-byte characters and tokenizer spacing right; text
    is held back while it ends in an incomplete character or could still be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token_ids) -> str:
        """Feed new tokens; return the text that is now final."""
        self.ids.extend(token_ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            start = max(0, self.emitted - self.holdback)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self.holdback
        while safe > self.emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.emitted:
            return ""
        delta = self.text[self.emitted:safe]
        self.emitted = safe
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


class Generation:
    """One request: decided, submitted, and read back, with one retry on another mode if its mode fails.

    A mode that fails a request (an ``error`` event, or refusing the submission) is quarantined by the
    registry; if nothing has been sent to the client yet, the request is decided again without that mode
    and resubmitted once. Call :meth:`prime` before committing to a response (it waits for the first
    tokens, so the mode named in headers is the one that really serves), then iterate :meth:`deltas`.
    """

    MAX_ATTEMPTS = 2

    def __init__(self, service: "Service", prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...],
                 pinned: str | None, task: str = "general") -> None:
        self.service = service
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.pinned = pinned
        self.assembler = TextAssembler(service.tokenizer, stop)
        self.attempts: list[str] = []
        self.finish_reason = "length"
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.extra: dict[str, Any] = {}
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        #: every mode's in-flight request-seconds at the first token (``Service.load_seconds``)
        self._loads_at_first: dict[str, tuple[float, float]] = {}
        #: the prompt tokens its engine computed before its first token and while it decoded, where the engine counts
        self._prefilled: tuple[int, int] | None = None
        #: set once the response streams its text: from then on a failed attempt cannot be retried unseen (a
        #: response sent whole can be: its text is read to the end before anything is sent)
        self.streamed = False
        self.finished_at: float | None = None
        self._pending: list[Event] = []
        self._excluded: frozenset[str] = frozenset()
        self._recorded = False
        self._spent_j = 0.0  # energy of earlier attempts on modes that failed the request
        self.request: GenRequest | None = None
        #: the mode and prompt tokens this request has still to compute there, counted in the service's
        #: ``prefilling`` until its first token (or its end)
        self._owed: tuple[str, int] | None = None
        #: the mode it is counted as running on in the service's ``running`` (until it ends or moves on)
        self._running_on: str | None = None
        self.logprobs: dict | None = None  # prompt scoring results (see GenerateEngine._score)
        #: generated tokens' logprobs (when asked for), and how many :meth:`take_logprobs` has handed out
        self.token_logprobs: list[TokenLogprobs] = []
        self._logprobs_taken = 0
        with service.routing:
            t0 = time.perf_counter()
            self.features = service.features(self.prompt_ids, params, task)
            self.features_us = (time.perf_counter() - t0) * 1e6
            self._submit()

    # ------------------------------------------------------------------ decide and submit
    def _submit(self) -> None:
        """Decide and submit; a mode that refuses the submission is excluded and the decision retaken.
        Raises :class:`NoEligibleMode` when nothing can take the request."""
        registry = self.service.registry
        while True:
            decision = self.service.controller.decide(self.features, pinned=self.pinned, exclude=self._excluded)
            req = GenRequest(prompt_ids=self.prompt_ids, params=self.params)
            try:
                registry.modes[decision.mode].engine.submit(req)
            except Exception as exc:  # full since the decision, or the engine refused: try the next choice
                full = isinstance(exc, QueueFull)
                if not full:
                    registry.modes[decision.mode].record_failure(f"submit: {exc}")
                if self.pinned is not None:
                    raise NoEligibleMode(f"pinned mode {self.pinned!r} cannot take the request: {exc}",
                                         Code.SATURATED if full else Code.QUARANTINED,
                                         frozenset((self.pinned,)) if full else frozenset()) from exc
                self.attempts.append(f"{decision.mode}: {exc}")
                self._excluded = self._excluded | {decision.mode}
                continue
            if self.request is not None:
                self._spent_j += self.request.energy_j
            self.decision, self.request = decision, req
            self._owed = self.service.owe(decision.mode, len(self.prompt_ids)
                                          - self.features.prefix_match_by_mode.get(decision.mode, 0))
            self._leave()
            self._running_on = self.service.join(decision.mode, self)
            self.service.metrics.decided(decision.mode, decision.rule, decision.decision_us / 1e6)
            return

    def _fail(self, error: str) -> None:
        """The current mode failed the request: quarantine it, and retry elsewhere if still allowed."""
        state = self.service.registry.modes[self.mode]
        state.record_failure(error)
        self.attempts.append(f"{self.mode}: {error}")
        if self.pinned is not None or self.streamed or len(self.attempts) >= self.MAX_ATTEMPTS:
            self._record("error")
            raise GenerationError(f"mode {self.mode} failed: {error}")
        self._excluded = self._excluded | {self.mode}
        self._settle()
        self._restart_text()
        try:
            self._submit()
        except NoEligibleMode as exc:
            self._record("error")
            raise GenerationError(f"mode {self.mode} failed ({error}) and no other mode can retry: {exc}") from None

    def _restart_text(self) -> None:
        """Forget what a failed attempt generated (nothing of it was sent): the retry's text replaces it."""
        self.assembler = TextAssembler(self.service.tokenizer, self.assembler.stop)
        self.completion_tokens = 0
        self.first_token_at = None
        self.token_logprobs, self._logprobs_taken = [], 0

    def _record(self, outcome: str) -> None:
        """Report the request once (ok, error, or cancelled by the client) to the controller's observers."""
        if self._recorded:
            return
        self._recorded = True
        self._settle()
        self._leave()
        end = self.finished_at or time.perf_counter()
        ttft = tpot = None
        n = self.completion_tokens
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.started_at
            tpot = (end - self.first_token_at) / (n - 1) if n > 1 else None
        scoring = self.params.prompt_logprobs is not None
        if outcome == "ok" and not scoring:
            self.service.registry.modes[self.mode].record_energy(self.request.energy_j, n, end - self.started_at)
        self.service.controller.observe(Completed(
            mode=self.mode, features=self.features, outcome=outcome, ttft_s=ttft, tpot_s=tpot,
            latency_s=end - self.started_at, prompt_tokens=len(self.prompt_ids), completion_tokens=n,
            energy_j=self.energy_j, energy_source=self.service.registry.energy.source, retried=bool(self.attempts),
            scoring=scoring, prompt_ids=tuple(self.prompt_ids), output_ids=tuple(self.assembler.ids),
            target_steps=self.extra.get("speculative", {}).get("target_steps"),
            loads_met=self.service.loads_met(self._loads_at_first) if tpot is not None else None,
            prefilled_tokens=self._prefilled))

    def _next_event(self) -> Event:
        if self._pending:
            return self._pending.pop(0)
        try:
            return self.request.events.get(timeout=EVENT_TIMEOUT_S)
        except queue.Empty:
            return Event("error", info={"error": f"no output for {EVENT_TIMEOUT_S:.0f} s"})

    def prime(self) -> None:
        """Wait until the request produces its first tokens (or finishes), retrying on a failing mode."""
        while True:
            event = self._next_event()
            if event.kind == "error":
                self._fail(event.info.get("error", "unknown error"))
                continue
            self._pending.insert(0, event)
            return

    # ------------------------------------------------------------------ results
    @property
    def mode(self) -> str:
        return self.decision.mode

    @property
    def energy_j(self) -> float:
        """Energy attributed to this request so far (all attempts), in joules."""
        return self._spent_j + self.request.energy_j

    def energy(self) -> dict[str, Any]:
        """The request's energy for ``usage`` and the ``modeswitch`` block; ``source`` says measured or estimated."""
        out = {"energy_j": round(self.energy_j, 6), "energy_source": self.service.registry.energy.source}
        if self.completion_tokens:
            out["j_per_token"] = round(self.energy_j / self.completion_tokens, 6)
        return out

    def deltas(self) -> Iterator[str]:
        """Text as it becomes final; raises :class:`GenerationError` if the request cannot be served."""
        outcome = "cancelled"  # unless the loop below completes: the reader went away
        try:
            while True:
                event = self._next_event()
                if event.kind == "error":
                    self._fail(event.info.get("error", "unknown error"))
                    continue
                if event.kind == "tokens":
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                        self._loads_at_first = self.service.load_seconds()
                        self._settle()
                    self.completion_tokens += len(event.token_ids)
                    self.token_logprobs += event.info.get("logprobs", ())
                    delta = self.assembler.add(self._visible(event.token_ids))
                    if delta:
                        yield delta
                    if self.assembler.stopped:
                        self.finish_reason = "stop"
                        self.request.cancel()
                        self.service.registry.modes[self.mode].record_success()
                        break
                elif event.kind == "done":
                    self.service.registry.modes[self.mode].record_success()
                    self.cached_tokens = event.info.get("cached_tokens", 0)
                    reason = event.info.get("finish_reason", "length")
                    self.finish_reason = "stop" if reason in ("stop", "cancelled") else reason
                    if "speculative" in event.info:
                        self.extra["speculative"] = event.info["speculative"]
                    self._prefilled = event.info.get("prefilled_tokens")
                    self.logprobs = event.info.get("logprobs")
                    tail = self.assembler.flush()
                    if tail:
                        yield tail
                    break
            outcome = "ok"
        finally:
            self._finish(outcome)

    def _visible(self, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens whose text the answer shows: a ``stop_token_ids`` token ends the generation and, as vLLM
        writes it, is not part of the text (an end-of-sequence token is a special token, never shown)."""
        stops = self.params.stop_token_ids
        if not stops:
            return token_ids
        cut = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        return token_ids[:cut]

    @property
    def text(self) -> str:
        """The text generated so far (all of it once :meth:`deltas` has ended)."""
        return self.assembler.text

    def take_logprobs(self) -> list[TokenLogprobs]:
        """The generated tokens' logprobs that arrived since the last call (the text they make has been yielded,
        or is held back by the detokenizer)."""
        new = self.token_logprobs[self._logprobs_taken:]
        self._logprobs_taken = len(self.token_logprobs)
        return new

    def _settle(self) -> None:
        """The prompt is computed (or will not be, on this mode): it no longer counts as prefill ahead of others."""
        if self._owed is not None:
            self.service.owe(*self._owed, paid=True)
            self._owed = None

    def _leave(self) -> None:
        """No longer generating on its mode (it ended, or moves to another): it leaves the service's ``running``."""
        if self._running_on is not None:
            self.service.leave(self._running_on, self)
            self._running_on = None

    @property
    def tokens_left(self) -> int:
        """The most tokens it may still generate."""
        return max(self.params.max_tokens - self.completion_tokens, 0)

    def _finish(self, outcome: str) -> None:
        self.finished_at = time.perf_counter()
        self.request.cancel()  # no-op when finished; frees the engine slot when the reader goes away early
        self._record(outcome)

    def close(self) -> None:
        """Give up on a request that was not read to the end (another prompt of its response failed, or the
        response was never sent): cancel it so the engine frees its slot, and count it as cancelled.
        Nothing happens to a request already counted."""
        if not self._recorded:
            self._finish("cancelled")

    def report(self) -> dict[str, Any]:
        """The ``modeswitch`` block of a response."""
        end = self.finished_at or time.perf_counter()
        timings = {"total_s": round(end - self.started_at, 4)}
        if self.first_token_at is not None:
            timings["ttft_s"] = round(self.first_token_at - self.started_at, 4)
            if self.completion_tokens > 1:
                timings["decode_tok_s"] = round((self.completion_tokens - 1) / max(end - self.first_token_at, 1e-9), 2)
        if self._prefilled is not None:
            timings["engine_prompt_tokens"] = dict(zip(("before_first_token", "while_decoding"), self._prefilled))
        out = {
            "mode": self.mode,
            "reason": self.decision.reason,
            "policy": self.decision.policy,
            "features": self.features.as_dict(),
            "decision_us": round(self.decision.decision_us, 1),
            "decision_wall_us": round(self.decision.decision_wall_us, 1),
            "features_us": round(self.features_us, 1),
            **({"prediction": rounded(self.decision.prediction)} if self.decision.prediction else {}),
            "timings": timings,
            "cached_tokens": self.cached_tokens,
            "energy": self.energy(),
            **self.extra,
        }
        if self.attempts:
            out["attempts"] = self.attempts
        if self.decision.gate_pending:  # pinned to a mode no quality verdict holds for on these kernels yet
            out["quality_gate"] = {"status": "pending", "reason": self.decision.gate_pending}
        return out


def rounded(value: Any) -> Any:
    """A decision's prediction as a response shows it: its seconds to 4 decimals (kept exact while deciding)."""
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return round(value, 4) if isinstance(value, float) else value


class Service:
    def __init__(self, registry: ModeRegistry, controller: Controller, model_name: str) -> None:
        self.registry = registry
        self.controller = controller
        self.model_name = model_name
        self.tokenizer = registry.tokenizer
        self.metrics = Metrics(registry, model_name)
        #: held from a request's features to its submission, so that the next request's features see it: in
        #: flight (queue depth) and, on an engine that records a prompt's prefix when it is added (vLLM's
        #: shadow), as a prefix match. Without it a burst of requests sharing a new prefix all read "no
        #: match" and skip the cache (3-4 of every 17 in vLLM's prefix_repetition client at 4 concurrent).
        #: Held for microseconds: submitting never waits on generation.
        self.routing = threading.Lock()
        #: per mode, the prompt tokens its requests in flight have still to compute (``Features.prefilling_by_mode``)
        self.prefilling: dict[str, int] = {}
        #: per mode, its requests in flight (``Features.decode_overlap_by_mode`` reads how many tokens each has left)
        self.running: dict[str, set[Generation]] = {}
        self._in_flight_lock = threading.Lock()
        controller.add_observer(self.metrics.finished)
        #: what drafting would do for a request (its features), learned from every completed one
        self.speculation = SpeculationModel()
        controller.add_observer(self.speculation.observe)
        #: what each engine costs here: measured at start (:meth:`calibrate`), corrected by every finished request
        self.costs = controller.costs
        controller.add_observer(self.costs.observe)
        self.rebind()

    def rebind(self) -> None:
        """Tell the controller, the speculation model and the cost model how the resident modes share engines
        and lanes, as they stand now (again once the modes of a staged start have come up)."""
        self.controller.rebind()
        modes = [m for m in self.registry.modes.values() if m.available]
        # an engine's drafting requests are a stream of their own: they share the plain ones' batch but cost
        # more a step (an engine drafts only for its speculative modes' requests)
        stream = {m.spec.name: f"{m.batch} drafting" if m.speculative else m.batch for m in modes}
        pairs, k = {}, []
        for m in modes:
            if not m.speculative:
                continue
            plain = sorted((p for p in modes if p.spec.weights == m.spec.weights and not p.speculative),
                           key=lambda p: -p.batch_slots)  # the batch a request would otherwise join
            if plain:
                pairs[m.spec.name] = plain[0].spec.name
                k.append(m.spec.speculative.num_tokens)
        self.speculation.bind(max(k, default=REPLAY_K))
        self.costs.bind(Binding(
            streams=stream,
            # the CPUs an engine computes on, where the backend pinned it (else every mode shares one lane)
            lanes={m.spec.name: ",".join(map(str, m.details.get("cpus", ()))) for m in modes},
            engines={m.spec.name: m.batch for m in modes},
            slots={m.spec.name: m.batch_slots for m in modes},
            drafting=frozenset(m.spec.name for m in modes if m.speculative),
            keys={stream[m.spec.name]: stream_key(machine(), self.model_name, self.registry.backend_name, stream[m.spec.name], m.details) for m in modes},
            pairs=pairs,
            weights={m.spec.name: m.spec.weights for m in modes}))

    def load_seconds(self) -> dict[str, tuple[float, float]]:
        """Every mode's in-flight request-seconds so far, with when it was read (``Engine.load_seconds``)."""
        out = {}
        for name, state in self.registry.modes.items():
            reading = state.load_seconds()
            if reading is not None:
                out[name] = reading
        return out

    def loads_met(self, since: Mapping[str, tuple[float, float]]) -> dict[str, float] | None:
        """Per mode with requests in flight since the readings ``since`` (:meth:`load_seconds`), their mean number
        since; None without readings, or where an engine was replaced meanwhile (its count started again)."""
        if not since:
            return None
        out = {}
        for name, (then, counted) in since.items():
            reading = self.registry.modes[name].load_seconds()
            if reading is None or reading[1] < counted or reading[0] <= then:
                return None
            if reading[1] > counted:
                out[name] = (reading[1] - counted) / (reading[0] - then)
        return out

    def owe(self, mode: str, tokens: int, paid: bool = False) -> tuple[str, int]:
        """Count ``tokens`` of prompt as still to compute on ``mode`` (or, ``paid``, as computed)."""
        with self._in_flight_lock:
            self.prefilling[mode] = self.prefilling.get(mode, 0) + (-tokens if paid else tokens)
        return mode, tokens

    def join(self, mode: str, generation: Generation) -> str:
        """Count ``generation`` as running on ``mode``."""
        with self._in_flight_lock:
            self.running.setdefault(mode, set()).add(generation)
        return mode

    def leave(self, mode: str, generation: Generation) -> None:
        with self._in_flight_lock:
            self.running[mode].discard(generation)

    def decode_overlap(self, max_tokens: int) -> dict[str, float]:
        """Per mode with requests running, ``Features.decode_overlap_by_mode`` for a request of ``max_tokens``."""
        m = max(max_tokens, 1)
        with self._in_flight_lock:
            return {mode: sum(min(g.tokens_left, m) for g in gens) / m for mode, gens in self.running.items() if gens}

    def features(self, prompt_ids: list[int], params: SamplingParams, task: str = "general") -> Features:
        n = len(prompt_ids)
        by_mode = self.registry.prefix_matches(prompt_ids)
        match = max(by_mode.values(), default=0)
        in_flight = {name: state.in_flight for name, state in self.registry.modes.items()}
        free, fraction = memory_headroom()
        drafting = self.speculation.estimate(prompt_ids, task)
        features = Features(
            prompt_tokens=n,
            max_tokens=params.max_tokens,
            prefix_match_tokens=match,
            prefix_match_ratio=match / n if n else 0.0,
            queue_depth=sum(in_flight.values()),
            memory_headroom=fraction,
            memory_free_gb=free / 2**30,
            greedy=int(params.greedy),
            prefix_match_by_mode=by_mode,
            task=task,
            scoring=int(params.prompt_logprobs is not None),
            in_flight_by_mode=in_flight,
            prefilling_by_mode=self.prefilling.copy(),
            decode_overlap_by_mode=self.decode_overlap(params.max_tokens),
            prefix_cache_batched=int(any(self.registry.modes[name].batch_slots > 1 for name in by_mode)),
            prompt_repeat=drafting.repeat,
            draft_tokens_per_step=drafting.tokens_per_step,
            drafts_per_step=drafting.drafts_per_step,
            needs=tuple(sorted(params.needs)),
        )
        if "speculation_gain" not in self.controller.policy.tested_features:
            return features
        gain = self.costs.speculation_gain(features, drafting.tokens_per_step) if self.costs.binding.pairs else 0.0
        return dataclasses.replace(features, speculation_gain=gain)

    def start(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
              mode: str | None = None, task: str = "general") -> Generation:
        """Decide and submit; raises :class:`NoEligibleMode` when nothing can take the request."""
        return Generation(self, prompt_ids, params, stop, mode, task)

    def start_behind(self, ahead: list[Generation], prompt_ids: list[int], params: SamplingParams,
                     stop: tuple[str, ...] = (), mode: str | None = None, task: str = "general") -> Generation:
        """:meth:`start` one of a request's prompts (or choices) behind the ones it started (``ahead``): where the
        modes it could use are saturated while some of those are generating there, it waits for one of them to
        finish and decides again, as vLLM queues a request's prompts. A request of more prompts than the modes'
        queues hold is served whole, not refused for the room its own prompts take; saturation by other requests
        alone is answered at once. Once all of its own there have ended, it decides once more (the counts it was
        refused on may have been read while the last of them ended) before it gives up."""
        settled = False
        while True:
            try:
                return self.start(prompt_ids, params, stop, mode, task)
            except NoEligibleMode as exc:
                mine = [g.request for g in ahead if g.mode in exc.saturated and g.request is not None]
                running = [req for req in mine if not req.released]
                if not running:
                    if not mine or settled:
                        raise
                    settled = True
                    continue
                released = threading.Event()
                for req in running:
                    req.after_release(released.set)
                if not released.wait(EVENT_TIMEOUT_S):
                    raise
