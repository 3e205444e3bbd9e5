"""The radix tree against a brute-force reference on random token sequences."""

from __future__ import annotations

import random

import pytest

from modeswitch.radix import RadixTree


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
