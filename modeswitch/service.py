"""What a request goes through between HTTP and an engine: features, decision, submission, text.

:class:`Service` is the only place that knows both the controller and the engines. It turns a tokenized
prompt into a :class:`Generation`, which yields text deltas (incremental detokenization, stop strings)
and ends with the finish reason, token counts, timings and the decision that chose the mode.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from .controller.decide import Controller, Decision, NoEligibleMode
from .controller.features import Features
from .engines.base import GenRequest, QueueFull, SamplingParams
from .pool import ModePool, memory_headroom

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


@dataclass
class Generation:
    """One request in flight on one mode: iterate :meth:`deltas`, then read the results."""

    decision: Decision
    request: GenRequest
    assembler: TextAssembler
    attempts: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    completion_tokens: int = 0
    cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def mode(self) -> str:
        return self.decision.mode

    def deltas(self) -> Iterator[str]:
        """Text as it becomes final; raises :class:`GenerationError` if the engine fails the request."""
        req = self.request
        try:
            while True:
                try:
                    event = req.events.get(timeout=EVENT_TIMEOUT_S)
                except Exception as exc:
                    raise GenerationError(f"mode {self.mode} produced nothing for {EVENT_TIMEOUT_S:.0f} s") from exc
                if event.kind == "tokens":
                    if self.first_token_at is None:
                        self.first_token_at = time.perf_counter()
                    self.completion_tokens += len(event.token_ids)
                    delta = self.assembler.add(event.token_ids)
                    if delta:
                        yield delta
                    if self.assembler.stopped:
                        self.finish_reason = "stop"
                        req.cancel()
                        break
                elif event.kind == "done":
                    self.cached_tokens = event.info.get("cached_tokens", 0)
                    reason = event.info.get("finish_reason", "length")
                    self.finish_reason = "stop" if reason in ("stop", "cancelled") else reason
                    if "speculative" in event.info:
                        self.extra["speculative"] = event.info["speculative"]
                    tail = self.assembler.flush()
                    if tail:
                        yield tail
                    break
                else:
                    raise GenerationError(f"mode {self.mode} failed: {event.info.get('error', 'unknown error')}")
        finally:
            self.finished_at = time.perf_counter()
            req.cancel()  # no-op when finished; frees the engine slot when the reader goes away early

    @property
    def text(self) -> str:
        return self.assembler.text

    def report(self) -> dict[str, Any]:
        """The ``modeswitch`` block of a response."""
        req = self.request
        end = self.finished_at or time.perf_counter()
        timings = {"total_s": round(end - req.submitted_at, 4)}
        if self.first_token_at is not None:
            timings["ttft_s"] = round(self.first_token_at - req.submitted_at, 4)
            if self.completion_tokens > 1:
                timings["decode_tok_s"] = round((self.completion_tokens - 1) / max(end - self.first_token_at, 1e-9), 2)
        out = {
            "mode": self.mode,
            "reason": self.decision.reason,
            "policy": self.decision.policy,
            "features": self.decision.features.as_dict(),
            "decision_us": round(self.decision.decision_us, 1),
            "timings": timings,
            "cached_tokens": self.cached_tokens,
            **self.extra,
        }
        if self.attempts:
            out["attempts"] = self.attempts
        return out


class Service:
    def __init__(self, pool: ModePool, controller: Controller, model_name: str) -> None:
        self.pool = pool
        self.controller = controller
        self.model_name = model_name
        self.tokenizer = pool.tokenizer

    def features(self, prompt_ids: list[int], params: SamplingParams) -> Features:
        n = len(prompt_ids)
        by_mode = self.pool.prefix_matches(prompt_ids)
        match = max(by_mode.values(), default=0)
        free, fraction = memory_headroom()
        return Features(
            prompt_tokens=n,
            max_tokens=params.max_tokens,
            prefix_match_tokens=match,
            prefix_match_ratio=match / n if n else 0.0,
            queue_depth=self.pool.in_flight(),
            memory_headroom=fraction,
            memory_free_gb=free / 2**30,
            greedy=int(params.greedy),
            prefix_match_by_mode=by_mode,
        )

    def start(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...] = (),
              mode: str | None = None) -> Generation:
        """Decide and submit. A mode whose queue filled between decision and submission is skipped and the
        decision retaken; raises :class:`NoEligibleMode` when nothing can take the request."""
        features = self.features(prompt_ids, params)
        exclude: frozenset[str] = frozenset()
        attempts: list[str] = []
        while True:
            decision = self.controller.decide(features, pinned=mode, exclude=exclude)
            engine = self.pool.modes[decision.mode].engine
            req = GenRequest(prompt_ids=list(prompt_ids), params=params)
            try:
                engine.submit(req)
            except Exception as exc:  # full since the decision, or the engine refused: try the next choice
                full = isinstance(exc, QueueFull)
                if mode is not None:
                    raise NoEligibleMode(f"pinned mode {mode!r} cannot take the request: {exc}", saturated=full) from exc
                attempts.append(f"{decision.mode}: {exc}")
                exclude = exclude | {decision.mode}
                continue
            return Generation(decision, req, TextAssembler(self.tokenizer, stop), attempts)
