"""Prefix-KV store: longest reusable prefix, private copies, LRU eviction by token budget."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from modeswitch.engines.transformers.prefix_kv import PrefixKVStore


class _Config:
    num_hidden_layers = 2


def make_cache(n: int) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(2):
        k = torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).repeat(1, 2, 1, 4) + layer
        cache.update(k, k.clone(), layer)
    return cache


def test_lookup_crops_a_private_copy_and_leaves_one_token_to_compute():
    store = PrefixKVStore(capacity_tokens=100)
    store.store(list(range(10)), make_cache(10))
    n, cache = store.lookup(list(range(10)))  # the whole prompt is stored: one token must still run
    assert n == 9 and cache.get_seq_length() == 9
    n, cache = store.lookup(list(range(6)) + [99, 98])
    assert n == 6 and cache.get_seq_length() == 6
    cache.crop(2)  # mutating the copy leaves the stored entry intact
    assert store.lookup(list(range(10)))[1].get_seq_length() == 9
    assert store.lookup([5, 6, 7]) == (0, None)
    s = store.stats()
    assert (s["prefix_queries"], s["prefix_hits"], s["prefix_hit_tokens"]) == (4, 3, 24)


def test_lru_eviction_keeps_within_the_token_budget():
    store = PrefixKVStore(capacity_tokens=25)
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    store.store(a, make_cache(10))
    store.store(b, make_cache(10))
    store.lookup(a + [0])  # touch a: b becomes least recently used
    store.store(c, make_cache(10))
    assert store.match_length(b) == 0
    assert store.match_length(a) == 10 and store.match_length(c) == 10
    assert store.stats()["prefix_cached_tokens"] == 20
    store.store(a[:5], make_cache(5))  # already covered by a longer entry: nothing added
    assert store.stats()["prefix_entries"] == 2
