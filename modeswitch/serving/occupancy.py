"""How busy the whole server is: the three figures a cluster router reads to pick a replica.

The Gateway API inference extension's endpoint picker (and llm-d's) scrape ``vllm:num_requests_waiting``,
``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` from each model server. A ModeSwitch server
is one replica to such a router, whatever modes it runs, so the figures are summed over its modes here and
exported under those names by :mod:`modeswitch.serving.metrics`.

Each engine splits its own in-flight requests into waiting and running
(:meth:`~modeswitch.engines.base.Engine.waiting_running`): transformers' ``generate()`` runs one at a time,
its continuous-batching manager and vLLM run what their schedulers hold (vLLM's as the driver estimates it,
its counts being in another process). Every mode has an engine of its own (vLLM modes a front of their own
on a shared runner), so summing modes counts each request once.

KV usage is the fraction of the KV pools reserved at start that running requests hold, weighted by each
pool's size in tokens; a pool that several modes share is counted once. KV that is only kept for reuse
(prefix caches, transformers' ``PrefixKVStore``) counts as free, as vLLM counts its cached blocks: it is
given up on demand and never delays a request. With no such pool (transformers' ``generate()`` modes only,
whose caches are allocated per request) the usage reads 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engines.base import KvUse
    from .registry import ModeRegistry


@dataclass(frozen=True)
class Occupancy:
    """Requests waiting and running on the whole server, the fraction of its KV pools in use, and per mode
    its (waiting, running)."""

    waiting: int
    running: int
    kv_cache_usage: float
    per_mode: dict[str, tuple[int, int]]


def occupancy(registry: "ModeRegistry") -> Occupancy:
    """The server's occupancy now, read from every mode that has an engine. At most one pass over each
    engine's running requests: cheap enough for every scrape and a router polling each second."""
    per_mode: dict[str, tuple[int, int]] = {}
    pools: dict[object, KvUse] = {}
    for name, state in registry.modes.items():
        if state.engine is None:
            continue
        per_mode[name] = state.engine.waiting_running()
        if (use := state.engine.kv_use()) is not None:
            pools[use.pool] = use
    capacity = sum(use.capacity for use in pools.values())
    held = sum(use.held for use in pools.values())
    return Occupancy(waiting=sum(w for w, _ in per_mode.values()), running=sum(r for _, r in per_mode.values()),
                     kv_cache_usage=held / capacity if capacity else 0.0, per_mode=per_mode)
