"""Workloads: the reference design's six request shapes, a mixed trace of them, prefix-reuse sweeps, and
arrival patterns. Prompts are token windows of real English prose (modeswitch.weights.corpus), never random ids.

Each run draws its prompts from its own stretch of text (``run`` selects it), so one run's prompts never
start where another run's did: a prefix cache filled by an earlier run cannot flatter a later one. Within
a run, shared-prefix requests share one prefix, as turns of one chat with a long system prompt would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TypeVar

from ..weights.corpus import paragraphs


@dataclass(frozen=True)
class Shape:
    name: str
    prompt_tokens: int
    max_tokens: int
    shared_prefix: int = 0  # leading tokens shared by every request of this shape in a run

    def scaled(self, scale: float) -> "Shape":
        def s(n: int, floor: int) -> int:
            return max(floor, int(round(n * scale)))

        return replace(self, prompt_tokens=s(self.prompt_tokens, 8), max_tokens=s(self.max_tokens, 4),
                       shared_prefix=s(self.shared_prefix, 0) if self.shared_prefix else 0)


#: The reference design's workloads (prompt tokens -> output tokens).
REFERENCE = (
    Shape("short_short", 128, 32),
    Shape("short_long", 128, 128),
    Shape("long_short", 1024, 32),
    Shape("long_long", 1024, 128),
    Shape("shared_prefix", 1024, 128, shared_prefix=768),
    Shape("memory_pressure", 2048, 128),
)


@dataclass
class Slot:
    """One request of a trace. ``index`` is its position, the same in every run of the trace, so runs can be
    compared request by request (the oracle)."""

    index: int
    workload: str
    prompt_ids: list[int]
    max_tokens: int
    at: float | None = None  # arrival time in seconds from the start (open loop); None: closed loop


class TextSource:
    """Token windows of the corpus; each run starts at its own offset (a prime stride apart, so runs that wrap
    around the corpus still start their prompts at different tokens)."""

    STRIDE = 50_021

    def __init__(self, tokenizer) -> None:
        ids: list[int] = []
        for text in paragraphs():
            ids.extend(tokenizer(text + "\n\n").input_ids)
        self.ids = ids

    def reader(self, run: int):
        pos = (run * self.STRIDE) % len(self.ids)

        def take(n: int) -> list[int]:
            nonlocal pos
            out = [self.ids[(pos + i) % len(self.ids)] for i in range(n)]
            pos = (pos + n + 1) % len(self.ids)
            return out

        return take


T = TypeVar("T")


def rotated(items: list[T], by: int) -> list[T]:
    """``items`` rotated left by ``by`` places (modulo their number): from the ``by``-th on, then those before it."""
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


def rotated_rounds(contenders: list[T], count: int) -> list[tuple[int, T]]:
    """(round, contender) for ``count`` rounds over every contender, each round's order rotated by one from the
    last: a machine that slows down during a run slows every contender alike, and none always runs first."""
    return [(r, c) for r in range(count) for c in rotated(contenders, r)]


def trace(source: TextSource, shapes: list[Shape], count: int, run: int, seed: int = 0) -> list[Slot]:
    """``count`` requests whose shapes are drawn (seeded: the same in every run) from ``shapes``."""
    order = random.Random(seed).choices(shapes, k=count)
    take = source.reader(run)
    prefixes = {s.name: take(s.shared_prefix) for s in shapes if s.shared_prefix}
    slots = []
    for i, shape in enumerate(order):
        head = prefixes.get(shape.name, [])
        slots.append(Slot(i, shape.name, head + take(shape.prompt_tokens - len(head)), shape.max_tokens))
    return slots


def prefix_reuse(source: TextSource, count: int, run: int, prompt_tokens: int, max_tokens: int,
                 prefix_fraction: float, prefixes: int, seed: int = 0) -> list[Slot]:
    """A prefix-reuse workload: ``prefixes`` distinct shared prefixes of ``prefix_fraction`` of the prompt
    (suffix diversity: how many conversations share the server), each request picking one at random."""
    take = source.reader(run)
    shared = int(prompt_tokens * prefix_fraction)
    heads = [take(shared) for _ in range(prefixes)]
    rng = random.Random(seed)
    return [Slot(i, f"prefix{prefix_fraction:g}x{prefixes}", rng.choice(heads) + take(prompt_tokens - shared),
                 max_tokens) for i in range(count)]


def arrivals(slots: list[Slot], pattern: str, rate: float = 1.0, burst: int = 4, seed: int = 0) -> list[Slot]:
    """Give slots arrival times: ``closed`` (none: the client sends when a worker is free), ``poisson`` at
    ``rate`` requests/s, or ``burst``: groups of ``burst`` requests every ``burst / rate`` seconds."""
    if pattern == "closed":
        return [replace(s, at=None) for s in slots]
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, s in enumerate(slots):
        if pattern == "poisson":
            t += rng.expovariate(rate)
        elif pattern == "burst":
            t = (i // burst) * burst / rate
        else:
            raise ValueError(f"unknown arrival pattern {pattern!r} (closed, poisson, burst)")
        out.append(replace(s, at=t))
    return out
