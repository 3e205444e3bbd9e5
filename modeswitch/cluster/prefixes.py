"""A compact, shareable summary of the prompt prefixes a replica has served: chained hashes of fixed-size
character blocks.

A replica's prefix cache lives in its engines (a radix tree of token sequences in the transformers engine,
vLLM's block hashes); shipping it to the router every second would be large and engine-specific. Instead a
replica records, for every prompt it accepts, the hash of each whole block-aligned prefix of the prompt text
(``hash(prefix[:64])``, ``hash(prefix[:128])``, ... chained so each costs one block), keeps the prompts its
largest prefix cache can hold (:class:`PrefixLog`, bounded in tokens as that cache is), and publishes their
blocks in its routing stats. The router hashes the incoming prompt the same way and counts how many leading
blocks a replica holds: how much of the prompt's prefill the replica can skip, to within one block, without a
round trip.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from itertools import takewhile

#: characters per block: about 16 tokens of English, the granularity of vLLM's and our KV block reuse
BLOCK_CHARS = 64


def block_hashes(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """The chained hash of every whole block-aligned prefix of ``text`` (a trailing partial block is not
    counted: an engine reuses whole blocks only)."""
    hashes = []
    h = b""
    for end in range(block, len(text) + 1, block):
        h = hashlib.blake2b(h + text[end - block:end].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(h, "little"))
    return hashes


def matched_blocks(hashes: list[int], holds: Callable[[int], bool]) -> int:
    """How many leading blocks of a prompt (its ``hashes``) a replica ``holds``."""
    return sum(1 for _ in takewhile(holds, hashes))


class PrefixLog:
    """The prompts a replica took most recently, as many as its prefix cache holds, and the union of their
    blocks.

    Bounded like the engines' caches are: in tokens, evicting whole prompts least recently used first (a
    transformers prefix store keeps one entry per sequence, vLLM evicts the blocks of the oldest requests),
    so the summary claims what the replica's cache most likely still holds, not everything it ever saw."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._prompts: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        self._blocks: Counter[int] = Counter()
        self._tokens = 0

    def record(self, text: str, tokens: int) -> None:
        """A prompt of ``tokens`` tokens was taken (again)."""
        hashes = block_hashes(text)
        if not hashes or tokens > self.capacity_tokens:
            return
        key = hash(text)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return
        self._prompts[key] = (hashes, tokens)
        self._blocks.update(hashes)
        self._tokens += tokens
        while self._tokens > self.capacity_tokens:
            old, n = self._prompts.popitem(last=False)[1]
            self._tokens -= n
            self._blocks.subtract(old)
            for h in old:
                if self._blocks[h] <= 0:
                    del self._blocks[h]

    def summary(self) -> list[int]:
        return list(self._blocks)
