"""A shadow of a paged KV cache's prefix reuse, kept beside an engine whose cache lives out of reach.

vLLM holds its KV blocks in its engine-core process and answers only after a request has run how many
prompt tokens it reused. The controller needs that figure *before* it routes (the ``prefix_match_tokens``
feature), so the engine's front records the token sequences the engine has computed KV for and answers
from this record: the approximate prefix cache that routers in front of vLLM keep (llm-d's, Ray Serve's
prefix-cache affinity router).

It follows vLLM's rules for what is reusable: only whole blocks (a block is cached once it is full and
scheduled), never the prompt's last token (its logits must be computed), sequences sharing their common
blocks, and a bounded number of blocks with the least recently used sequences evicted first. Its errors
cost little: eviction drops whole sequences, not single blocks (low), and a prompt recorded when its
request is added counts before vLLM has scheduled it (high, for at most a step; the request that relies on
it is scheduled after it, and a mode that reads the cache on vLLM costs nothing when nothing is there).
"""

from __future__ import annotations

import threading

from ..radix import LruRadix


class PagedPrefixShadow:
    """Token sequences whose KV a paged cache of ``capacity_blocks`` blocks of ``block_size`` tokens holds."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._sequences: LruRadix[None] = LruRadix(block_size * capacity_blocks, shared=True)
        self._lock = threading.Lock()

    def record(self, computed_ids: list[int]) -> None:
        """The engine has computed (or scheduled) KV for ``computed_ids``: its full blocks are in the cache."""
        full = len(computed_ids) // self.block_size * self.block_size
        if full:
            with self._lock:
                self._sequences.put(computed_ids[:full], None)

    def match(self, prompt_ids: list[int]) -> int:
        """Prompt tokens the engine would take from its cache: whole blocks, short of the prompt's last token."""
        with self._lock:
            held = self._sequences.longest_match(prompt_ids)[0]
        return max(min(held, len(prompt_ids) - 1), 0) // self.block_size * self.block_size

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"shadow_blocks": self._sequences.tokens // self.block_size,
                    "shadow_sequences": len(self._sequences)}
