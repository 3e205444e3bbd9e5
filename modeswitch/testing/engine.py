"""A scripted engine: deterministic tokens at a set pace, with faults and slowness injected by the test."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..engines.base import Engine, GenRequest, TokenLogprobs
from ..sampling_params import OPTIONS
from ..engines.radix import RadixTree
from ..modes import ModeSpec


@dataclass(frozen=True)
class Script:
    """How a fake mode behaves. The text it generates is a function of the prompt alone (the same in every
    mode, as greedy output of real modes is), so tests can compare modes."""

    #: the answer to every request, its UTF-8 bytes as tokens (the fake tokenizer's), ending ("stop") as a model
    #: ends its answer, unless max_tokens cuts it ("length"); None: scripted letters up to max_tokens
    reply: str | None = None

    #: seconds before the first token, and between tokens
    ttft_s: float = 0.0
    token_s: float = 0.0
    #: seconds added between tokens per other request generating on the engine (a batch step growing with the
    #: batch), and per prompt token before the first (prefill growing with the prompt)
    load_s: float = 0.0
    prompt_token_s: float = 0.0
    #: the CPUs its engine computes on (the card's ``cpus``: modes on other CPUs run on another lane)
    cpus: tuple[int, ...] = ()
    #: fail every request after the start-up warm-up (an engine that broke while serving)
    fault: bool = False
    #: fail the warm-up too (an engine that never works: the registry lists the mode as unavailable)
    broken: bool = False
    #: fail every request after the warm-up once it has generated this many tokens (an engine dying mid-request)
    fail_after: int | None = None
    #: requests generated at once; more wait in its queue (1: one at a time)
    batch: int = 8
    #: None: as the mode's spec implies (a continuous-batching mode honours no request option and reserves its
    #: KV, as transformers' does; a prefix-cache mode reports the longest prompt prefix it has seen; the others
    #: claim every option but a grammar, which they cannot follow)
    capabilities: frozenset[str] | None = None
    preallocated_kv: bool | None = None
    prefix_cache: bool | None = None


def next_token(context: list[int]) -> int:
    """The scripted continuation: lower-case ASCII letters, a function of the last token."""
    return 97 + (context[-1] * 7 + len(context)) % 26 if context else 97


class FakeEngine(Engine):
    def __init__(self, spec: ModeSpec, script: Script) -> None:
        super().__init__(spec.max_queue)
        batched = spec.batching == "continuous"
        self.script = script
        self.batch_slots = script.batch  # its workers serve the queue first come, first served
        self.capabilities = ((frozenset() if batched else OPTIONS - {"structured_outputs"})
                             if script.capabilities is None else script.capabilities)
        self.preallocated_kv = batched if script.preallocated_kv is None else script.preallocated_kv
        prefix_cache = spec.prefix_cache if script.prefix_cache is None else script.prefix_cache
        self.submitted = 0
        self.generating = 0  # requests being served (what load_s scales with)
        self._count = threading.Lock()
        # as engines report them; the fake's tree is unbounded, so its capacity is "more than any test uses"
        self.prefix = {"prefix_queries": 0, "prefix_hits": 0, "prefix_hit_tokens": 0, "prefix_capacity_tokens": 2**30}
        self._prefixes = RadixTree() if prefix_cache else None
        self._queue: queue.Queue[tuple[GenRequest, bool] | None] = queue.Queue()
        self._stop = threading.Event()
        self._workers = [threading.Thread(target=self._loop, name=f"fake-{spec.name}-{i}", daemon=True)
                         for i in range(script.batch)]
        for worker in self._workers:
            worker.start()

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        return self._prefixes.longest_match(prompt_ids)[0] if self._prefixes is not None else None

    def _enqueue(self, req: GenRequest) -> None:
        self.submitted += 1
        self._queue.put((req, self.submitted == 1))  # the registry's warm-up is the first request

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            req, warm_up = item
            try:
                self._serve(req, warm_up)
            except Exception as exc:  # a bug here must fail the request, not hang it
                req.emit("error", error=f"{type(exc).__name__}: {exc}")

    def _serve(self, req: GenRequest, warm_up: bool) -> None:
        with self._count:
            self.generating += 1
        try:
            self._generate(req, warm_up)
        finally:
            with self._count:
                self.generating -= 1

    def _generate(self, req: GenRequest, warm_up: bool) -> None:
        script = self.script  # read once: a test may swap the engine's script between requests
        if script.ttft_s or script.prompt_token_s:
            time.sleep(script.ttft_s + script.prompt_token_s * len(req.prompt_ids))
        if script.broken or (script.fault and not warm_up):
            req.emit("error", error="RuntimeError: injected fault")
            return
        cached = self.prefix_match(req.prompt_ids) or 0
        if self._prefixes is not None and not warm_up:
            self._prefixes.insert(req.prompt_ids, True)
            self.prefix["prefix_queries"] += 1
            self.prefix["prefix_hits"] += cached > 0
            self.prefix["prefix_hit_tokens"] += cached
        if req.params.prompt_logprobs is not None:
            self._score(req)
            return
        context = list(req.prompt_ids)
        reply = None if script.reply is None else script.reply.encode()
        for i in range(req.params.max_tokens):
            if reply is not None and i == len(reply):
                req.emit("done", finish_reason="stop", cached_tokens=cached)
                return
            if req.cancelled.is_set():
                req.emit("done", finish_reason="cancelled", cached_tokens=cached)
                return
            if i and (script.token_s or script.load_s):
                time.sleep(script.token_s + script.load_s * (self.generating - 1))
            if i == script.fail_after and not warm_up:
                req.emit("error", error="RuntimeError: injected fault after tokens")
                return
            token = next_token(context) if reply is None else reply[i]
            context.append(token)
            if req.params.logprobs is not None:  # the scripted token is the likeliest, at -1; then 97, 98, ...
                ranked = [token] + [t for t in range(97, 123) if t != token]
                top = {t: -float(j + 1) for j, t in enumerate(ranked[: req.params.logprobs])}
                req.emit("tokens", [token], logprobs=[TokenLogprobs(token, -1.0, top)])
            else:
                req.emit("tokens", [token])
        req.emit("done", finish_reason="length", cached_tokens=cached)

    def _score(self, req: GenRequest) -> None:
        """Prompt logprobs in the shape the transformers engine returns (see GenerateEngine._score)."""
        ids = req.prompt_ids
        following = next_token(ids)
        k = max(1, req.params.prompt_logprobs)
        tops = [{t: -float(j + 1) for j, t in enumerate(range(97, 97 + k))} for _ in ids]
        req.emit("tokens", [following])
        req.emit("done", finish_reason="length", cached_tokens=0,
                 logprobs={"token_ids": ids + [following], "token_logprobs": [None] + [-1.0] * len(ids),
                           "top_logprobs": [None] + tops})

    def stats(self) -> dict[str, Any]:
        return {"submitted": self.submitted, **(self.prefix if self._prefixes is not None else {})}

    def close(self) -> None:
        self._stop.set()
        for _ in self._workers:
            self._queue.put(None)
