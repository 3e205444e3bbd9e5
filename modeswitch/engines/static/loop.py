"""The decode loop the project owns: every one-at-a-time mode as options of one static-cache loop.

fp16, INT8 and GPTQ differ only in the model handed in (their linear layers; see :mod:`modeswitch.weights.kernels`);
``prefix_store`` copies stored KV into the static cache and prefills only the new suffix; ``drafter`` turns decode
steps into verify steps over proposed tokens. All of them run the same three compiled step shapes of a
:class:`~modeswitch.engines.static.decoder.StaticDecoder`, so on a GPU every mode decodes from CUDA graphs, where
``generate()`` runs prefix reuse, speculative decoding and INT8 eagerly, launch-bound (docs/gpu.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import GenRequest
from ..grammar import Grammars
from ..transformers.prefix_kv import PrefixKVStore
from ..transformers.processors import Decoding, stop_ids
from ..transformers.worker import SerialEngine, finish_reason
from .decoder import StaticDecoder
from .drafts import Drafter, ModelDrafter
from .sampling import accept


#: the options a drafting loop honours: the rest are logits processors, which a verify step does not run
SPECULATIVE_OPTIONS = frozenset({"temperature", "top_p", "seed", "stop_token_ids", "ignore_eos", "prompt_logprobs"})


class StaticLoopEngine(SerialEngine):
    """Prefill, then decode (or verify draft tokens) one step at a time over the engine's static cache.

    ``compile``: a ``torch.compile`` mode, or None for eager (tests; CPUs by default never get here)."""

    def __init__(self, name: str, model, max_queue: int, max_len: int, *, prefix_store: PrefixKVStore | None = None,
                 drafter: Drafter | None = None, compile: str | None = None, chunk: int = 64,
                 grammars: Grammars | None = None) -> None:
        super().__init__(name, model, max_queue, prefix_store, grammars)
        self.drafter = drafter
        if drafter is not None:  # a verify step accepts drafts by temperature and top-p alone (sampling.accept)
            self.capabilities = self.capabilities & SPECULATIVE_OPTIONS
        self.preallocated_kv = prefix_store is None  # stored prefixes are copies made per request
        k = drafter.k if drafter is not None else 0
        self.counters["verify_steps"] = 0  # target steps that verified drafts (the others decoded one token)
        self.decoder = StaticDecoder(model, max_len, chunk=chunk, verify_tokens=k, compile=compile)
        self.warmup_s: float | None = None

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    def warm_up(self) -> float:
        """Compile (and on a GPU capture) every step shape on the worker thread that will replay them, the draft
        model's too; returns the seconds it took."""

        def run() -> float:
            seconds = self.decoder.warm_up()
            if isinstance(self.drafter, ModelDrafter):
                seconds += self.drafter.decoder.warm_up()
            return seconds

        self.warmup_s = self.call(run)
        return self.warmup_s

    def _step(self, req: GenRequest, fed: list[int], position: int) -> torch.Tensor:
        """Feed ``fed`` at ``position`` (one token: a decode step; more: a verify step), metered."""
        with self._metered_step([(req, len(fed), position + len(fed))]):
            if len(fed) == 1:
                return self.decoder.decode(fed[0], position)[None]
            return self.decoder.verify(fed, position)

    @torch.inference_mode()
    def _generate(self, req: GenRequest) -> None:
        p, prompt = req.params, req.prompt_ids
        cached = 0
        if self.prefix_store is not None:
            cached, snap = self.prefix_store.lookup(prompt)
            if snap is not None:
                self.decoder.load(snap)
        with self._metered_step([(req, len(prompt) - cached, len(prompt))]):
            logits = self.decoder.prefill(prompt[cached:], cached)
        decoding = Decoding(p, len(prompt), self.eos, self.grammars)
        ends = stop_ids(p, self.eos)
        new = [decoding.choose(prompt, logits)]
        if self.drafter is not None:
            self.drafter.reset()
        generated: list[int] = []
        steps = tokens = 0
        while True:
            keep = []
            for token in new:
                keep.append(token)
                if token in ends or len(generated) + len(keep) >= p.max_tokens:
                    break
            generated += keep
            steps, tokens = steps + 1, tokens + len(keep)
            lps = decoding.logprobs(keep)
            req.emit("tokens", keep, **({"logprobs": lps} if lps else {}))
            if len(keep) < len(new) or keep[-1] in ends or len(generated) >= p.max_tokens or req.cancelled.is_set():
                break
            position = len(prompt) + len(generated) - 1  # where the last token goes: every earlier one is fed
            remaining = p.max_tokens - len(generated)
            drafts = self.drafter.propose(prompt + generated, remaining) if self.drafter is not None else []
            if not drafts:
                new = [decoding.choose(prompt + generated, self._step(req, generated[-1:], position)[0])]
                continue
            if self.decoder.compiled:  # one verify shape: pad; a padded token is a proposal like any other
                drafts = drafts + [0] * (self.drafter.k - len(drafts))
            logits = self._step(req, [generated[-1]] + drafts, position)
            self.counters["verify_steps"] += 1
            new = accept(logits, drafts, p, decoding.generator)
        if self.prefix_store is not None:
            fed = len(prompt) + len(generated) - 1
            self.prefix_store.store((prompt + generated)[:fed], self.decoder.snapshot(fed))
        spec = self._count_done(len(generated), *((steps, tokens) if self.speculative else ()))
        req.emit("done", finish_reason=finish_reason(req, generated, ends), cached_tokens=cached, **spec)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        if self.warmup_s is not None:
            stats["warmup_s"] = round(self.warmup_s, 2)
        return stats
