"""The radix tree against a brute-force reference on random token sequences."""

from __future__ import annotations

import random

import pytest

from modeswitch.engines.radix import LruRadix, RadixTree


def brute_longest(stored: dict, query) -> int:
    best = 0
    for seq in stored:
        n = 0
        while n < min(len(seq), len(query)) and seq[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


def test_random_insert_match_remove_agree_with_brute_force():
    rng = random.Random(7)
    tree: RadixTree[tuple] = RadixTree()
    stored: dict = {}
    base = [rng.randrange(5) for _ in range(40)]
    for step in range(600):
        # sequences share prefixes often (small alphabet, common base), like chat prompts do
        seq = tuple(base[: rng.randrange(1, 30)] + [rng.randrange(5) for _ in range(rng.randrange(0, 10))])
        action = rng.random()
        if action < 0.5:
            tree.insert(seq, seq)
            stored[seq] = seq
        elif action < 0.7 and stored:
            victim = rng.choice(list(stored))
            assert tree.remove(victim)
            del stored[victim]
        length, value = tree.longest_match(seq)
        assert length == brute_longest(stored, seq), step
        if length:
            assert value in stored and value[:length] == seq[:length]
        else:
            assert value is None
        assert len(tree) == len(stored)
    assert sorted(tree.values()) == sorted(stored)


def test_remove_absent_and_prefix_of_stored():
    tree: RadixTree[str] = RadixTree()
    tree.insert((1, 2, 3, 4), "a")
    assert not tree.remove((1, 2))  # a path inside an edge holds no value
    assert not tree.remove((9,))
    tree.insert((1, 2), "b")
    assert tree.remove((1, 2, 3, 4))
    assert tree.longest_match((1, 2, 3)) == (2, "b")
    with pytest.raises(ValueError):
        tree.insert((), "empty")


def test_tree_counts_the_distinct_tokens_on_its_edges():
    tree: RadixTree[str] = RadixTree()
    tree.insert((1, 2, 3, 4), "a")
    tree.insert((1, 2, 5), "b")  # shares (1, 2): one new token
    assert tree.tokens == 5
    tree.remove((1, 2, 3, 4))
    assert tree.tokens == 3
    tree.remove((1, 2, 5))
    assert tree.tokens == 0 and len(tree) == 0


def test_lru_radix_bounds_shared_or_copied_tokens_and_evicts_least_recently_used():
    system = tuple(range(100, 110))
    a, b, c = system + (1, 1), system + (2, 2), system + (3, 3)
    copied, shared = LruRadix(30, shared=False), LruRadix(30, shared=True)
    for store in (copied, shared):
        store.put(a, "a")
        store.put(b, "b")
        store.get(store.longest_match(a)[1])  # a used again: b is now the least recently used
        store.put(c, "c")
    # three 12-token copies exceed 30: b went; shared, the 10-token prefix counts once (10 + 3 x 2 = 16)
    assert copied.longest_match(b)[0] == 10 and copied.tokens == 24 and len(copied) == 2
    assert shared.longest_match(b)[0] == 12 and shared.tokens == 16 and len(shared) == 3
    shared.put(a[:5], "covered")  # a prefix of a stored sequence: nothing new to hold
    assert len(shared) == 3
    shared.put(tuple(range(40)), "too long")  # longer than the whole bound: not stored
    assert shared.longest_match(tuple(range(40)))[0] == 0
