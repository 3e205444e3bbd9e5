"""A compact, shareable summary of the prompt prefixes a replica has served: chained hashes of fixed-size
character blocks.

A replica's prefix cache lives in its engines (a radix tree of token blocks in the transformers engine,
vLLM's block hashes); shipping it to the router every second would be large and engine-specific. Instead a
replica records, for every prompt it accepts, the hash of each whole block-aligned prefix of the prompt text
(``hash(prefix[:64])``, ``hash(prefix[:128])``, ... chained so each costs one block), keeps the most recent
``capacity`` of them, and publishes them in its routing stats. The router hashes the incoming prompt the same
way and counts how many leading blocks a replica holds: that is how much of the prompt's prefill the replica
can skip, to within one block, without a round trip. The capacity plays the part of the engines' cache size:
what the replica has not seen recently is likely evicted there too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection

#: characters per block: about 16 tokens of English, the granularity of vLLM's and our KV block reuse
BLOCK_CHARS = 64
#: block hashes a replica publishes (64 ki blocks = 4 MB of prompt text; 512 KiB of stats)
DEFAULT_CAPACITY = 65536


def block_hashes(text: str, block: int = BLOCK_CHARS) -> list[int]:
    """The chained hash of every whole block-aligned prefix of ``text`` (a trailing partial block is not
    counted: an engine reuses whole blocks only)."""
    hashes = []
    h = b""
    for end in range(block, len(text) + 1, block):
        h = hashlib.blake2b(h + text[end - block:end].encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(h, "little"))
    return hashes


def matched_blocks(hashes: list[int], held: Collection[int]) -> int:
    """How many leading blocks of a prompt (its ``hashes``) are in ``held``."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class PrefixLog:
    """The recent block hashes of one replica, least recently used evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()

    def record(self, text: str) -> None:
        for h in block_hashes(text):
            self._held[h] = None
            self._held.move_to_end(h)
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)

    def summary(self) -> list[int]:
        return list(self._held)
