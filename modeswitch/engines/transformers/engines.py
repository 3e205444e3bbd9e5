"""The transformers engine: portable, runs anywhere torch does.

Two workers cover every mode option; a mode's options are constructor arguments, not new classes:

* :class:`GenerateEngine` runs eager ``model.generate`` one request at a time, optionally with prefix-KV reuse
  (:class:`~modeswitch.engines.transformers.prefix_kv.PrefixKVStore`) and/or speculative decoding (a draft model, or
  prompt-lookup n-grams when the preset has no draft).
* :class:`ContinuousBatchingEngine` feeds transformers' continuous-batching manager (paged KV, requests
  join and leave the running batch every step).

Modes that use the same weights are handed the same model object (see ``modeswitch.weights.store``): one resident
copy, its forward pass serialized across the engines' threads.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..base import Engine, GenRequest, KvUse, paged_tokens, stalled
from ..grammar import Grammars
from .prefix_kv import PrefixKVStore
from .processors import Decoding, stop_ids
from .worker import SerialEngine, eos_ids, finish_reason

#: what a speculative ``generate()`` cannot do: its verify step runs the processors over every drafted position at
#: once, which xgrammar's processor (one call per accepted token) and the per-step logprob record do not follow
SPECULATIVE_LIMITS = frozenset({"logprobs", "structured_outputs"})

class _EventStreamer(BaseStreamer):
    """Forwards each step's new tokens to the request, meters each step (the interval between two outputs is
    one forward step of the request), and counts target steps for speculative statistics."""

    def __init__(self, engine: Engine, req: GenRequest, cached: int, decoding: Decoding) -> None:
        self.engine = engine
        self.req = req
        self.decoding = decoding
        self.prompt_seen = False
        self.kv = cached  # tokens in the KV cache
        self.open_step: int | None = None
        self.steps = 0
        self.tokens = 0

    def put(self, value: torch.Tensor) -> None:
        ids = value.reshape(-1).tolist()
        self.engine._end_step(self.open_step)
        if not self.prompt_seen:  # generate() first streams the prompt itself: the next step is its prefill
            self.prompt_seen = True
            new = len(ids) - self.kv
        else:
            self.steps += 1
            self.tokens += len(ids)
            lps = self.decoding.logprobs(ids)
            self.req.emit("tokens", ids, **({"logprobs": lps} if lps else {}))
            new = len(ids)  # the next step feeds these back (speculative: about as many as it will verify)
        self.kv += new
        self.open_step = self.engine._begin_step([(self.req, new, self.kv)])

    def end(self) -> None:
        self.engine._end_step(self.open_step)
        self.open_step = None


class _StopWhenCancelled(StoppingCriteria):
    def __init__(self, req: GenRequest) -> None:
        self.req = req

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.req.cancelled.is_set(), dtype=torch.bool, device=input_ids.device)


class GenerateEngine(SerialEngine):
    """One eager ``generate()`` at a time on a worker thread (batch size 1, as transformers' speculative path
    needs), over a dynamic cache. The compiled static-cache path is the owned loop
    (:mod:`modeswitch.engines.static.loop`), which the backend picks instead where it is faster (GPUs).
    """

    def __init__(
        self,
        name: str,
        model,
        max_queue: int,
        prefix_store: PrefixKVStore | None = None,
        draft_model=None,
        prompt_lookup_tokens: int | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.draft_model = draft_model
        self.prompt_lookup_tokens = prompt_lookup_tokens
        super().__init__(name, model, max_queue, prefix_store, grammars)
        if self.speculative:
            self.capabilities = self.capabilities - SPECULATIVE_LIMITS

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or self.prompt_lookup_tokens is not None

    @torch.inference_mode()
    def _generate(self, req: GenRequest) -> None:
        device = self.model.device
        input_ids = torch.tensor([req.prompt_ids], device=device)
        p = req.params
        decoding = Decoding(p, len(req.prompt_ids), self.eos, self.grammars)
        ends = stop_ids(p, self.eos)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=p.max_tokens,
            stopping_criteria=StoppingCriteriaList([_StopWhenCancelled(req)]),
            logits_processor=decoding.processors,
            return_dict_in_generate=True,
            attention_mask=torch.ones_like(input_ids),
            pad_token_id=self.model.generation_config.pad_token_id,
            eos_token_id=sorted(ends),  # [] (ignore_eos): nothing ends it early, not even the model's default
            # sampling happens in the processors (processors.py), so that each request draws from its own generator
            do_sample=False, temperature=None, top_p=None, top_k=None,
        )
        cached = 0
        if self.prefix_store is not None:
            cached, cache = self.prefix_store.lookup(req.prompt_ids)
            kwargs["past_key_values"] = cache if cache is not None else DynamicCache(config=self.model.config)
        if self.draft_model is not None:
            kwargs["assistant_model"] = self.draft_model
        elif self.prompt_lookup_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        streamer = _EventStreamer(self, req, cached, decoding)
        try:
            out = self.model.generate(input_ids, streamer=streamer, **kwargs)
        finally:
            streamer.end()
        sequence = out.sequences[0].tolist()
        generated = sequence[len(req.prompt_ids):]
        if self.prefix_store is not None:
            kv = out.past_key_values
            self.prefix_store.store(sequence[: kv.get_seq_length()], kv)
        spec = self._count_done(len(generated), *((streamer.steps, streamer.tokens) if self.speculative else ()))
        req.emit("done", finish_reason=finish_reason(req, generated, ends), cached_tokens=cached, **spec)


class ContinuousBatchingEngine(Engine):
    """Requests join transformers' continuous-batching manager; a router thread fans its outputs back out.

    The manager's generation config is fixed at start, so this mode serves plain greedy requests only; the
    controller's capability gate keeps requests that set any decoding option away from it.

    Supervised by its backend like the one-at-a-time engines (:meth:`fault`, :meth:`abandon`, :meth:`resume`): a
    manager whose thread ended or whose batch step wedged is told to stop at once, its requests are answered, and a
    new manager (its own paged cache, queues and router thread) starts once the old manager's thread has left, so
    two managers never step on the shared model together. ``init_continuous_batching`` builds a new manager each
    time: transformers hands a manager back only if it was stopped with ``keep_for_next_session``, which this
    engine never asks for.
    """

    capabilities = frozenset()
    preallocated_kv = True  # the paged block pool is reserved at start

    def __init__(self, name: str, model, max_queue: int, num_blocks: int, max_batch_tokens: int, page_size: int,
                 graphs: bool = False) -> None:
        """``graphs`` (GPUs): capture the batch steps as CUDA graphs and compile them (transformers' own options);
        eager batch steps are launch-bound there (each layer's kernels launched from Python, every step)."""
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        super().__init__(max_queue)
        self.name = name
        self.model = model
        self.batch_slots = max_queue  # any request it accepts joins the batch, as its KV pool allows
        self.eos = eos_ids(model)
        self._gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=256,
            eos_token_id=sorted(self.eos) or -1,
            pad_token_id=model.generation_config.pad_token_id,
        )
        self._cb_config = ContinuousBatchingConfig(  # transformers resolves a copy per manager: reused as is
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            page_size=page_size,
            auto_switch_to_flash=False,  # the model object is shared with other modes: leave its attention as is
            **(dict(use_cuda_graph=True, default_compile_level=1) if graphs else {}),
        )
        self.page_size = page_size
        self.kv_capacity = num_blocks * page_size  # tokens of the pool as configured (transformers rounds to sectors)
        self.counters = {"requests": 0, "generated_tokens": 0, "max_concurrent": 0}
        self._active: dict[str, tuple[GenRequest, int]] = {}
        self._active_lock = threading.Lock()
        #: held while a manager starts or the engine closes, so that none starts (and reserves a pool) after
        #: :meth:`close`: the supervisor may be resuming the engine while the server closes it
        self._lifecycle = threading.Lock()
        self._closed = False
        self._start()

    def _start(self) -> None:
        """A new manager, its batch steps metered, and a router thread fanning out its outputs."""
        self.manager = self.model.init_continuous_batching(generation_config=self._gen_config,
                                                           continuous_batching_config=self._cb_config)
        self._manager_step = self.manager._generation_step
        self.manager._generation_step = self._metered_manager_step  # called once per batch step by its thread
        self._stop = threading.Event()
        self._stepped_at = time.monotonic()  # when the manager's last batch step began (what fault() reads)
        # a replaced manager whose thread failed is held, paged cache and all, by a reference cycle (the error it
        # recorded holds its loop's frame): collected before the new thread reserves its pool, so one pool at a time
        gc.collect()
        self.manager.start()
        self._router = threading.Thread(target=self._route, name=f"engine-{self.name}-router", daemon=True)
        self._router.start()

    def _enqueue(self, req: GenRequest) -> None:
        with self._active_lock:
            if not self._active:  # idle until now: no step was due
                self._stepped_at = time.monotonic()
            self._active[req.id] = (req, 0)
            self.counters["max_concurrent"] = max(self.counters["max_concurrent"], len(self._active))
        accepted = self.manager.add_request(
            input_ids=req.prompt_ids, request_id=req.id, max_new_tokens=req.params.max_tokens, streaming=True
        )
        if accepted is None:
            with self._active_lock:
                self._active.pop(req.id, None)
            raise RuntimeError("the continuous-batching manager is not accepting requests")

    def _metered_manager_step(self) -> None:
        """One step of the manager's batch, metered: each request's part is its query tokens at its KV length."""
        self._stepped_at = time.monotonic()
        if self.energy is None:
            return self._manager_step()
        io = self.manager.batch_processor.inputs_and_outputs
        host = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io  # async batching: two IO pairs
        with self._active_lock:
            work = [(self._active[f.state.request_id][0], f.query_length, f.state.position_offset)
                    for f in host.requests_in_batch if f.state.request_id in self._active]
        with self._metered_step(work):
            self._manager_step()

    def _route(self) -> None:
        while not self._stop.is_set():
            self._cancel_requested()
            out = self.manager.get_result(timeout=0.05)
            if out is None:
                continue
            with self._active_lock:
                entry = self._active.get(out.request_id)
            if entry is None:  # cancelled and already answered
                continue
            req, sent = entry
            if out.error:
                self._finish(req)
                req.emit("error", error=str(out.error))
                continue
            new = list(out.generated_tokens[sent:])
            if new:
                req.emit("tokens", new)
            with self._active_lock:
                self._active[req.id] = (req, sent + len(new))
            if out.is_finished():
                self._finish(req)
                self.counters["requests"] += 1
                self.counters["generated_tokens"] += len(out.generated_tokens)
                req.emit("done", finish_reason=finish_reason(req, list(out.generated_tokens), self.eos), cached_tokens=0)

    def _finish(self, req: GenRequest) -> None:
        with self._active_lock:
            self._active.pop(req.id, None)

    def _cancel_requested(self) -> None:
        with self._active_lock:
            cancelled = [req for req, _ in self._active.values() if req.cancelled.is_set()]
        for req in cancelled:
            self.manager.cancel_request(req.id)
            self._finish(req)
            req.emit("done", finish_reason="cancelled", cached_tokens=0)

    def _running(self) -> list[tuple[GenRequest, int]]:
        """(request, tokens sent) of the requests in the manager's running batch, as many as its scheduler holds
        active, taken oldest first: its FIFO scheduler admits in arrival order, and ``_active`` keeps that order."""
        processor = self.manager.batch_processor  # None until the manager's thread has started
        active = 0 if processor is None else len(processor.scheduler.active_requests)
        with self._active_lock:
            return list(self._active.values())[:active]

    def running_now(self) -> int:
        """What transformers' scheduler holds active (prefilling or decoding); the rest of this mode's requests
        wait in the manager's queues."""
        return len(self._running())

    def kv_use(self) -> KvUse:
        """The running requests' prompt and generated tokens in whole pages. Counted from the requests rather
        than read from the pool: transformers keeps finished requests' full blocks for prefix sharing and counts
        them as taken, though they are released on demand (vLLM counts such blocks as free)."""
        held = paged_tokens((len(req.prompt_ids) + sent for req, sent in self._running()), self.page_size)
        return KvUse(self, min(held, self.kv_capacity), self.kv_capacity)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.supervision()}

    def fault(self, stall_s: float) -> str | None:
        """Why the engine cannot serve any more, or None: transformers' manager thread ended (an error it
        caught: it fails the requests it held), our router thread ended, or a batch step has run past ``stall_s``
        with requests waiting on it."""
        if self._stop.is_set():
            return None
        if not self.manager.is_running():
            error = getattr(self.manager.background_thread_status, "fatal_error", None)
            return f"transformers' continuous-batching manager stopped ({error!r})"
        if not self._router.is_alive():
            return "its router thread exited"
        return stalled(self._stepped_at if self._active else None, stall_s)

    def abandon(self, reason: str) -> None:
        """Answer every request on it with ``reason`` and stop the manager without waiting for a wedged step: a hard
        stop, so that its thread leaves after the step under way instead of generating the answered requests on."""
        self._stop.set()
        with self._active_lock:
            pending = [req for req, _ in self._active.values()]
            self._active.clear()
        for req in pending:
            req.emit("error", error=reason)
        self.manager.stop(block=False, hard_stop=True)

    def resume(self) -> bool:
        """Start a new manager once the old manager's thread and the router have left; True when it serves again."""
        with self._lifecycle:
            if self._closed or self.manager.is_running() or self._router.is_alive():
                return False
            self._start()
            return True

    def close(self) -> None:
        with self._lifecycle:
            self._closed = True
        self._stop.set()
        self._router.join(timeout=5)
        self.manager.stop(block=True, timeout=30)
        with self._active_lock:
            pending = [req for req, _ in self._active.values()]
            self._active.clear()
        for req in pending:
            req.emit("error", error="server shutting down")
