"""Prefix-KV reuse for the transformers engine: stored KV caches keyed by their token sequence.

After a request finishes, the cache covering its prompt and output is kept (LRU, bounded in tokens).
A later prompt that starts with any stored sequence reuses that many positions of KV instead of
recomputing them: the ``prefix_cache`` mode's whole benefit (the first token comes without prefilling the
shared prefix again, most of the prompt where many requests share one).
"""

from __future__ import annotations

import copy
import threading

from ..radix import LruRadix


class PrefixKVStore:
    """LRU store of transformers caches under a radix tree of their token sequences.

    Every entry is a cache of its own, so the token bound counts each entry's full length."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: LruRadix[object] = LruRadix(capacity_tokens, shared=False)
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0

    def match_length(self, prompt_ids: list[int]) -> int:
        """Positions of ``prompt_ids`` whose KV is stored (the controller's prefix-match feature)."""
        with self._lock:
            return self._entries.longest_match(prompt_ids)[0]

    def lookup(self, prompt_ids: list[int]):
        """A private copy of the longest stored cache reusable for ``prompt_ids``, cropped to the match.

        At least one prompt token is left to compute, since generation needs the logits of the last one.
        Returns ``(reused_tokens, cache_or_None)``.
        """
        with self._lock:
            self.queries += 1
            length, key = self._entries.longest_match(prompt_ids)
            length = min(length, len(prompt_ids) - 1)
            if length <= 0 or key is None:
                return 0, None
            cache = copy.deepcopy(self._entries.get(key))
            self.hits += 1
            self.hit_tokens += length
        cache.crop(length)
        return length, cache

    def store(self, token_ids: list[int], cache) -> None:
        """Keep ``cache`` (covering exactly ``token_ids``), evicting least recently used entries to fit."""
        with self._lock:
            self._entries.put(token_ids, cache)

    def stats(self) -> dict:
        with self._lock:
            return {
                "prefix_queries": self.queries,
                "prefix_hits": self.hits,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_entries": len(self._entries),
                "prefix_cached_tokens": self._entries.tokens,
                "prefix_capacity_tokens": self.capacity_tokens,
            }
