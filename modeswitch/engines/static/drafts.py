"""Draft proposers for the owned loop's speculative decoding: each proposes up to ``k`` tokens to follow a
token history; the target's verify step decides what is kept (see :mod:`modeswitch.engines.static.sampling`).

* :class:`NgramDrafter`: prompt lookup, as transformers' ``prompt_lookup_num_tokens`` does it (the last 2-gram,
  else 1-gram, found earlier in the history; the tokens after its first occurrence). No weights, no forward pass.
* :class:`ModelDrafter`: a draft model decoded greedily over its own static cache (the preset's draft model,
  or the resident GPTQ weights of the same model as a quantized self-draft). Its cache is kept in step with the
  accepted history: after a verify step only the positions past the common prefix are fed again.
"""

from __future__ import annotations

from typing import Protocol

from .decoder import StaticDecoder


class Drafter(Protocol):
    k: int

    def propose(self, history: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens expected to follow ``history`` (possibly none)."""

    def reset(self) -> None:
        """A new request starts (its history shares nothing with the last one's)."""


class NgramDrafter:
    def __init__(self, k: int, max_ngram: int = 2) -> None:
        self.k = k
        self.max_ngram = max_ngram

    def propose(self, history: list[int], limit: int) -> list[int]:
        n_tokens = len(history)
        want = min(self.k, limit)
        for size in range(min(self.max_ngram, n_tokens - 1), 0, -1):
            tail = history[-size:]
            for start in range(n_tokens - size):
                if history[start:start + size] == tail:
                    follow = history[start + size:start + size + want]
                    if follow:
                        return follow
        return []

    def reset(self) -> None:
        pass


class ModelDrafter:
    def __init__(self, decoder: StaticDecoder, k: int) -> None:
        self.decoder = decoder
        self.k = k
        self._fed: list[int] = []  # tokens whose KV is in the draft cache, in order

    def propose(self, history: list[int], limit: int) -> list[int]:
        want = min(self.k, limit, self.decoder.max_len - len(history))
        if want <= 0:
            return []
        common = 0
        for a, b in zip(self._fed, history):
            if a != b:
                break
            common += 1
        common = min(common, len(history) - 1)  # at least one token to feed: its logits give the first draft
        logits = self.decoder.prefill(history[common:], common)
        self._fed = list(history)
        drafts = [int(logits.argmax())]
        while len(drafts) < want:
            logits = self.decoder.decode(drafts[-1], len(self._fed))
            self._fed.append(drafts[-1])
            drafts.append(int(logits.argmax()))
        return drafts

    def reset(self) -> None:
        self._fed = []
