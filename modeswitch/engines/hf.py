"""The transformers engine: portable, runs anywhere torch does.

Two workers cover every mode option; a mode's options are constructor arguments, not new classes:

* :class:`GenerateEngine` runs ``model.generate`` one request at a time, optionally with prefix-KV reuse
  (:class:`~modeswitch.engines.prefix_kv.PrefixKVStore`) and/or speculative decoding (a draft model, or
  prompt-lookup n-grams when the preset has no draft).
* :class:`ContinuousBatchingEngine` feeds transformers' continuous-batching manager (paged KV, requests
  join and leave the running batch every step).

Modes that use the same weights are handed the same model object (see ``modeswitch.weights``): one resident
copy, its forward pass serialized across the engines' threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .base import Engine, GenRequest, KvUse, paged_tokens, spec_tokens_per_step
from .prefix_kv import PrefixKVStore

log = logging.getLogger(__name__)


def eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


class _EventStreamer(BaseStreamer):
    """Forwards each step's new tokens to the request, meters each step (the interval between two outputs is
    one forward step of the request), and counts target steps for speculative statistics."""

    def __init__(self, engine: Engine, req: GenRequest, cached: int) -> None:
        self.engine = engine
        self.req = req
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
            self.req.emit("tokens", ids)
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


def _finish_reason(req: GenRequest, generated: list[int], eos: set[int]) -> str:
    if req.cancelled.is_set():
        return "cancelled"
    if generated and generated[-1] in eos:
        return "stop"
    return "length"


class GenerateEngine(Engine):
    """One ``generate()`` at a time on a worker thread (batch size 1, as transformers' speculative path needs).

    ``static_cache_len`` (plain modes on a GPU) selects the compiled static-cache decode path; prefix-KV
    reuse and speculative decoding keep the dynamic cache they are built on.
    """

    def __init__(
        self,
        name: str,
        model,
        max_queue: int,
        prefix_store: PrefixKVStore | None = None,
        draft_model=None,
        prompt_lookup_tokens: int | None = None,
        static_cache_len: int | None = None,
    ) -> None:
        super().__init__(max_queue)
        self.name = name
        self.model = model
        self.prefix_store = prefix_store
        self.draft_model = draft_model
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.static_cache_len = static_cache_len
        self.preallocated_kv = static_cache_len is not None
        self.eos = eos_ids(model)
        self.counters = {"requests": 0, "generated_tokens": 0, "spec_steps": 0, "spec_tokens": 0}
        self._queue: queue.Queue[GenRequest | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
        self._thread.start()

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or self.prompt_lookup_tokens is not None

    def _enqueue(self, req: GenRequest) -> None:
        self._queue.put(req)

    def _loop(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            if req.cancelled.is_set():
                req.emit("done", finish_reason="cancelled", cached_tokens=0)
                continue
            try:
                if req.params.prompt_logprobs is not None:
                    self._score(req)
                else:
                    self._generate(req)
            except Exception as exc:  # one request's failure must not stop the worker
                log.exception("mode %s failed a request", self.name)
                req.emit("error", error=f"{exc.__class__.__name__}: {exc}")

    @torch.inference_mode()
    def _generate(self, req: GenRequest) -> None:
        device = self.model.device
        input_ids = torch.tensor([req.prompt_ids], device=device)
        p = req.params
        kwargs: dict[str, Any] = dict(
            max_new_tokens=p.max_tokens,
            stopping_criteria=StoppingCriteriaList([_StopWhenCancelled(req)]),
            return_dict_in_generate=True,
            attention_mask=torch.ones_like(input_ids),
            pad_token_id=self.model.generation_config.pad_token_id,
        )
        if p.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=None)
        cached = 0
        if self.prefix_store is not None:
            cached, cache = self.prefix_store.lookup(req.prompt_ids)
            kwargs["past_key_values"] = cache if cache is not None else DynamicCache(config=self.model.config)
        if self.draft_model is not None:
            kwargs["assistant_model"] = self.draft_model
        elif self.prompt_lookup_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        elif self.static_cache_len is not None:
            # One static KV shape for every request: transformers compiles the decode step once (at warm-up)
            # and replays it, instead of launching each layer's kernels eagerly (4.4x faster decode of an
            # 8B model on an H200: 7.7 instead of 33.7 ms/step).
            kwargs.update(cache_implementation="static", max_cache_len=self.static_cache_len)
        streamer = _EventStreamer(self, req, cached)
        try:
            out = self.model.generate(input_ids, streamer=streamer, **kwargs)
        finally:
            streamer.end()
        sequence = out.sequences[0].tolist()
        generated = sequence[len(req.prompt_ids):]
        if self.prefix_store is not None:
            kv = out.past_key_values
            self.prefix_store.store(sequence[: kv.get_seq_length()], kv)
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(generated)
        info: dict[str, Any] = {"finish_reason": _finish_reason(req, generated, self.eos), "cached_tokens": cached}
        if self.speculative:
            self.counters["spec_steps"] += streamer.steps
            self.counters["spec_tokens"] += streamer.tokens
            info["speculative"] = {"target_steps": streamer.steps, "accepted_draft_tokens": streamer.tokens - streamer.steps}
        req.emit("done", **info)

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

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        return None if self.prefix_store is None else self.prefix_store.match_length(prompt_ids)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = dict(self.counters)
        if self.prefix_store is not None:
            stats.update(self.prefix_store.stats())
        return {**stats, **spec_tokens_per_step(self.counters)}

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        while True:  # anything still queued behind the sentinel gets an answer
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return
            if req is not None:
                req.emit("error", error="server shutting down")


class ContinuousBatchingEngine(Engine):
    """Requests join transformers' continuous-batching manager; a router thread fans its outputs back out.

    The manager's generation config is fixed at start, so this mode serves greedy requests only; the
    controller's capability gate keeps sampled requests away from it.
    """

    supports_sampling = False
    supports_scoring = False
    preallocated_kv = True  # the paged block pool is reserved at start

    def __init__(self, name: str, model, max_queue: int, num_blocks: int, max_batch_tokens: int, page_size: int) -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        super().__init__(max_queue)
        self.name = name
        self.eos = eos_ids(model)
        gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=256,
            eos_token_id=sorted(self.eos) or -1,
            pad_token_id=model.generation_config.pad_token_id,
        )
        cb_config = ContinuousBatchingConfig(
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            page_size=page_size,
            auto_switch_to_flash=False,  # the model object is shared with other modes: leave its attention as is
        )
        self.manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        self._manager_step = self.manager._generation_step
        self.manager._generation_step = self._metered_manager_step  # called once per batch step by its thread
        self.manager.start()
        self.page_size = page_size
        self.kv_capacity = num_blocks * page_size  # tokens of the pool as configured (transformers rounds to sectors)
        self.counters = {"requests": 0, "generated_tokens": 0, "max_concurrent": 0}
        self._active: dict[str, tuple[GenRequest, int]] = {}
        self._active_lock = threading.Lock()
        self._stop = threading.Event()
        self._router = threading.Thread(target=self._route, name=f"engine-{name}-router", daemon=True)
        self._router.start()

    def _enqueue(self, req: GenRequest) -> None:
        with self._active_lock:
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
                req.emit("done", finish_reason=_finish_reason(req, list(out.generated_tokens), self.eos), cached_tokens=0)

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
        return dict(self.counters)

    def close(self) -> None:
        self._stop.set()
        self._router.join(timeout=5)
        self.manager.stop(block=True)
        with self._active_lock:
            pending = [req for req, _ in self._active.values()]
            self._active.clear()
        for req in pending:
            req.emit("error", error="server shutting down")
