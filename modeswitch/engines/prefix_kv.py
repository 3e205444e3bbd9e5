"""Prefix-KV reuse for the transformers engine: stored KV caches keyed by their token sequence.

After a request finishes, the cache covering its prompt and output is kept (LRU, bounded in tokens).
A later prompt that starts with any stored sequence reuses that many positions of KV instead of
recomputing them: the ``prefix_cache`` mode's whole benefit (STACK.md: TTFT 5x lower for 512+32).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

from ..radix import RadixTree


class PrefixKVStore:
    """LRU store of transformers caches under a radix tree of their token sequences."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._tree: RadixTree[tuple[int, ...]] = RadixTree()
        self._entries: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.queries = 0
        self.hits = 0
        self.hit_tokens = 0

    def match_length(self, prompt_ids: list[int]) -> int:
        """Positions of ``prompt_ids`` whose KV is stored (the controller's prefix-match feature)."""
        with self._lock:
            return self._tree.longest_match(prompt_ids)[0]

    def lookup(self, prompt_ids: list[int]):
        """A private copy of the longest stored cache reusable for ``prompt_ids``, cropped to the match.

        At least one prompt token is left to compute, since generation needs the logits of the last one.
        Returns ``(reused_tokens, cache_or_None)``.
        """
        with self._lock:
            self.queries += 1
            length, key = self._tree.longest_match(prompt_ids)
            length = min(length, len(prompt_ids) - 1)
            if length <= 0 or key is None:
                return 0, None
            self._entries.move_to_end(key)
            cache = copy.deepcopy(self._entries[key])
            self.hits += 1
            self.hit_tokens += length
        cache.crop(length)
        return length, cache

    def store(self, token_ids: list[int], cache) -> None:
        """Keep ``cache`` (covering exactly ``token_ids``), evicting least recently used entries to fit."""
        key = tuple(token_ids)
        if not key or len(key) > self.capacity_tokens:
            return
        with self._lock:
            covered, holder = self._tree.longest_match(key)
            if covered == len(key):  # a stored sequence already extends this one
                self._entries.move_to_end(holder)
                return
            while self._tokens + len(key) > self.capacity_tokens and self._entries:
                old, _ = self._entries.popitem(last=False)
                self._tree.remove(old)
                self._tokens -= len(old)
            self._entries[key] = cache
            self._tree.insert(key, key)
            self._tokens += len(key)

    def stats(self) -> dict:
        with self._lock:
            return {
                "prefix_queries": self.queries,
                "prefix_hits": self.hits,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_entries": len(self._entries),
                "prefix_cached_tokens": self._tokens,
                "prefix_capacity_tokens": self.capacity_tokens,
            }
