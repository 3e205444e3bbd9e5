"""A radix tree over token-id sequences, and an LRU-bounded set of sequences built on it.

The transformers prefix-cache engine keeps its stored KV caches in one (to find the longest reusable
prefix of a new prompt), the vLLM engines keep a shadow of what their paged prefix cache holds in one,
and the controller asks the same trees for the ``prefix_match_tokens`` feature. Edges hold tuples of
tokens, so a walk costs one Python step per *edge*, with the token comparison done by tuple equality in
C; a lookup over a few stored sequences of 1000+ tokens stays in the microseconds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Generic, Iterator, Sequence, TypeVar

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("edge", "children", "value", "has_value")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge
        self.children: dict[int, _Node[V]] = {}
        self.value: V | None = None
        self.has_value = False

    def any_value(self) -> V | None:
        """A value stored at this node or anywhere below it (every such sequence extends this node's path)."""
        stack = [self]
        while stack:
            node = stack.pop()
            if node.has_value:
                return node.value
            stack.extend(node.children.values())
        return None


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixTree(Generic[V]):
    """Maps token sequences to values and answers longest-common-prefix queries."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node(())
        self._size = 0
        #: distinct tokens on the tree's edges: what the stored sequences hold when they share their prefixes
        self.tokens = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, tokens: Sequence[int], value: V) -> None:
        """Store ``value`` under the exact sequence ``tokens`` (replacing any value already there)."""
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("cannot store an empty sequence")
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf: _Node[V] = _Node(tokens[pos:])
                node.children[tokens[pos]] = leaf
                self.tokens += len(leaf.edge)
                node = leaf
                pos = len(tokens)
                break
            k = _common_length(child.edge, tokens[pos:pos + len(child.edge)])
            if k < len(child.edge):  # split the edge at k
                middle: _Node[V] = _Node(child.edge[:k])
                child.edge = child.edge[k:]
                middle.children[child.edge[0]] = child
                node.children[tokens[pos]] = middle
                child = middle
            node, pos = child, pos + k
        if not node.has_value:
            self._size += 1
        node.value, node.has_value = value, True

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, V | None]:
        """Length of the longest prefix of ``tokens`` shared with any stored sequence, and a value whose
        sequence starts with that prefix (``(0, None)`` when nothing matches)."""
        node, pos, n = self._root, 0, len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            edge = child.edge
            end = pos + len(edge)
            if end <= n and tuple(tokens[pos:end]) == edge:
                node, pos = child, end
                continue
            pos += _common_length(edge, tokens[pos:end])
            node = child
            break
        if pos == 0:
            return 0, None
        return pos, node.any_value()

    def remove(self, tokens: Sequence[int]) -> bool:
        """Drop the value stored under exactly ``tokens``; prune branches left empty. True if one was removed."""
        tokens = tuple(tokens)
        path: list[_Node[V]] = [self._root]
        pos = 0
        while pos < len(tokens):
            child = path[-1].children.get(tokens[pos])
            if child is None or tokens[pos:pos + len(child.edge)] != child.edge:
                return False
            path.append(child)
            pos += len(child.edge)
        node = path[-1]
        if not node.has_value or node is self._root:
            return False
        node.value, node.has_value = None, False
        self._size -= 1
        for parent, child in zip(reversed(path[:-1]), reversed(path[1:])):
            if child.has_value or child.children:
                if not child.has_value and len(child.children) == 1:  # merge a pass-through node with its child
                    (only,) = child.children.values()
                    only.edge = child.edge + only.edge
                    parent.children[child.edge[0]] = only
                break
            del parent.children[child.edge[0]]
            self.tokens -= len(child.edge)
        return True

    def values(self) -> Iterator[Any]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.has_value:
                yield node.value
            stack.extend(node.children.values())


class LruRadix(Generic[V]):
    """Token sequences with a value each, bounded in tokens; the least recently used sequence goes first.

    ``shared`` says how the bound counts: True when stored sequences share their common prefixes (the blocks
    of a paged KV cache: the distinct tokens of the tree count), False when each holds a copy of its own
    (separate KV caches: every sequence's length counts). Not thread-safe: callers hold their own lock.
    """

    def __init__(self, capacity_tokens: int, shared: bool = False) -> None:
        self.capacity_tokens = capacity_tokens
        self.shared = shared
        self._tree: RadixTree[tuple[int, ...]] = RadixTree()
        self._values: OrderedDict[tuple[int, ...], V] = OrderedDict()
        self._copied_tokens = 0

    def __len__(self) -> int:
        return len(self._values)

    @property
    def tokens(self) -> int:
        """Tokens held, counted as ``shared`` says."""
        return self._tree.tokens if self.shared else self._copied_tokens

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, tuple[int, ...] | None]:
        """Length of the longest stored prefix of ``tokens``, and the key of a sequence that holds it."""
        return self._tree.longest_match(tokens)

    def get(self, key: tuple[int, ...]) -> V:
        """The value stored under ``key`` (from :meth:`longest_match`), marked as just used."""
        self._values.move_to_end(key)
        return self._values[key]

    def put(self, tokens: Sequence[int], value: V) -> None:
        """Store ``value`` under ``tokens`` and evict the least recently used sequences until the bound holds.

        A sequence longer than the whole bound is not stored; one that a stored sequence already extends
        only marks that sequence as used (its prefix is already there)."""
        key = tuple(tokens)
        if not key or len(key) > self.capacity_tokens:
            return
        covered, holder = self._tree.longest_match(key)
        if covered == len(key):
            self._values.move_to_end(holder)
            return
        self._tree.insert(key, key)
        self._values[key] = value
        self._copied_tokens += len(key)
        while self.tokens > self.capacity_tokens:
            old = next(iter(self._values))  # never the new key: it alone fits the bound
            del self._values[old]
            self._tree.remove(old)
            self._copied_tokens -= len(old)
