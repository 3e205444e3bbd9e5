"""What every one-request-at-a-time transformers engine shares: a worker thread over a queue, prompt scoring,
prefix-store statistics, supervision and shutdown.

:class:`SerialEngine` is the base of ``generate()``'s engine (:mod:`.engines`) and of the owned static-cache loop
(:mod:`modeswitch.engines.static.loop`); a subclass supplies ``_generate`` only, so scoring and queueing behave
the same whichever decode path a mode takes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import torch

from ..base import Engine, GenRequest, spec_tokens_per_step, stalled
from ..grammar import Grammars
from .prefix_kv import PrefixKVStore

log = logging.getLogger(__name__)


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def finish_reason(req: GenRequest, generated: list[int], eos: set[int]) -> str:
    """``eos``: the tokens that end this request (``processors.stop_ids``)."""
    if req.cancelled.is_set():
        return "cancelled"
    if generated and generated[-1] in eos:
        return "stop"
    return "length"


class Detached(Exception):
    """Raised in a worker thread that its engine has given up on, at its next step: it leaves without touching
    the model again."""


class SerialEngine(Engine):
    """One request at a time on a worker thread. The queue also carries plain callables (:meth:`call`), so work
    that must run on the worker's own thread (compiling and capturing CUDA graphs) can be handed to it.

    Supervised by its backend (:meth:`fault`, :meth:`abandon`, :meth:`resume`): a worker thread that exited, or
    one whose step has run past a bound, is given up; the requests on it are answered; a new worker starts once
    the old thread is gone. A thread cannot be killed, so a wedged one is waited for: it leaves at its next
    step (:class:`Detached`), and the mode stays ``restarting`` until then. The new worker never runs beside it,
    as the two would share the model's caches (the owned loop's static KV cache).
    """

    def __init__(self, name: str, model, max_queue: int, prefix_store: PrefixKVStore | None = None,
                 grammars: Grammars | None = None) -> None:
        super().__init__(max_queue)
        self.name = name
        self.model = model
        self.prefix_store = prefix_store
        #: compiles constrained requests' grammars; without it the engine does not offer ``structured_outputs``
        self.grammars = grammars
        if grammars is None:
            self.capabilities = self.capabilities - {"structured_outputs"}
        self.eos = eos_ids(model)
        self.counters = {"requests": 0, "generated_tokens": 0, "spec_steps": 0, "spec_tokens": 0}
        self._queue: queue.Queue[GenRequest | Callable[[], None] | None] = queue.Queue()
        #: the request being served and when its last step began (what :meth:`fault` reads)
        self._current: GenRequest | None = None
        self._stepped_at = time.monotonic()
        self._given_up: threading.Thread | None = None  # a worker given up on, until it has left
        self._worker: threading.Thread | None = None
        self._closed = False  # a closed engine's worker leaves, and that is no fault
        self._start_worker()

    def _enqueue(self, req: GenRequest) -> None:
        self._queue.put(req)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread, between requests, and return its result (or raise its exception)."""
        done: queue.Queue = queue.Queue()

        def job() -> None:
            try:
                done.put((True, fn()))
            except BaseException as exc:  # handed back to the caller
                done.put((False, exc))

        self._queue.put(job)
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._loop, args=(self._queue,), name=f"engine-{self.name}", daemon=True)
        self._worker = thread  # before it runs: the loop serves while it is its engine's worker
        thread.start()

    def _loop(self, requests: queue.Queue) -> None:
        me = threading.current_thread()
        while self._worker is me:
            req = requests.get()
            if req is None:
                return
            if not isinstance(req, GenRequest):
                req()
                continue
            if req.cancelled.is_set():
                req.emit("done", finish_reason="cancelled", cached_tokens=0)
                continue
            self._current, self._stepped_at = req, time.monotonic()
            try:
                if req.params.prompt_logprobs is not None:
                    self._score(req)
                else:
                    self._generate(req)
            except Detached:
                return
            except Exception as exc:  # one request's failure must not stop the worker
                log.exception("mode %s failed a request", self.name)
                req.emit("error", error=f"{exc.__class__.__name__}: {exc}")
            if self._worker is me:  # a worker that exits on an uncaught error leaves its request to abandon()
                self._current = None

    def _begin_step(self, work):
        if threading.current_thread() is not self._worker:
            raise Detached(self.name)
        self._stepped_at = time.monotonic()
        return super()._begin_step(work)

    # ------------------------------------------------------------------ supervision
    def fault(self, stall_s: float) -> str | None:
        """Why the engine cannot serve any more, or None: its worker thread has exited (an error no request
        handler caught), or one step of the request it serves has run longer than ``stall_s``."""
        worker = self._worker
        if worker is None or self._closed:
            return None
        if not worker.is_alive():
            return "its worker thread exited"
        return stalled(self._stepped_at if self._current is not None else None, stall_s)

    def abandon(self, reason: str) -> None:
        """Give up on the worker: the request it serves and every request queued get an error (a request that has
        sent nothing is retried on another mode by the service), and the worker leaves at its next step."""
        self._given_up, self._worker = self._worker, None
        current, self._current = self._current, None
        if current is not None:
            current.emit("error", error=reason)
        queued, self._queue = self._queue, queue.Queue()
        while True:
            try:
                item = queued.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, GenRequest):
                item.emit("error", error=reason)
            elif item is not None:
                self._queue.put(item)  # work handed to the worker thread runs on the next one

    def resume(self) -> bool:
        """Start a new worker once the one given up on has left; True when the engine serves again."""
        if self._given_up is not None and self._given_up.is_alive():
            return False
        self._given_up = None
        self._start_worker()
        return True

    def _generate(self, req: GenRequest) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def _score(self, req: GenRequest) -> None:
        """One forward pass over the prompt: each token's logprob given what precedes it, the ``k`` most
        likely alternatives at each position, and the greedy next token with its own logprob."""
        ids = req.prompt_ids
        with self._metered_step([(req, len(ids), len(ids))]):
            logits = self.model(torch.tensor([ids], device=self.model.device)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        following = torch.tensor(ids[1:] + [int(logprobs[-1].argmax())], device=logprobs.device)
        chosen = logprobs.gather(1, following[:, None])[:, 0].tolist()
        k = max(1, req.params.prompt_logprobs)
        top_values, top_ids = logprobs.topk(k, dim=-1)
        tops = [dict(zip(i.tolist(), v.tolist())) for i, v in zip(top_ids, top_values)]
        next_token = int(following[-1])
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += 1
        req.emit("tokens", [next_token])
        req.emit("done", finish_reason="length", cached_tokens=0,
                 logprobs={"token_ids": ids + [next_token], "token_logprobs": [None] + chosen,
                           "top_logprobs": [None] + tops})

    def _count_done(self, generated: int, spec_steps: int | None = None, spec_tokens: int = 0) -> dict[str, Any]:
        """Count a finished request; returns the speculative part of its ``done`` info (empty if not speculative)."""
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += generated
        if spec_steps is None:
            return {}
        self.counters["spec_steps"] += spec_steps
        self.counters["spec_tokens"] += spec_tokens
        return {"speculative": {"target_steps": spec_steps, "accepted_draft_tokens": spec_tokens - spec_steps}}

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        return None if self.prefix_store is None else self.prefix_store.match_length(prompt_ids)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.counters)
        if self.prefix_store is not None:
            stats.update(self.prefix_store.stats())
        return {**stats, **spec_tokens_per_step(self.counters), **self.supervision()}

    def close(self) -> None:
        self._closed = True
        worker = self._worker
        self._queue.put(None)
        if worker is not None:
            worker.join(timeout=30)
        while True:  # anything still queued behind the sentinel gets an answer
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(req, GenRequest):
                req.emit("error", error="server shutting down")
