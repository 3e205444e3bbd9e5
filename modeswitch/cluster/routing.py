"""Ray Serve request routers for ModeSwitch replicas.

:class:`ModeSwitchRouter` places each generation request on the replica where it will be served best, from
what every replica publishes in its routing stats (:meth:`modeswitch.cluster.replica.ReplicaServer.routing_stats`)
and what this router itself sent in the last seconds; the chosen replica's own controller then picks the mode.
:class:`RoundRobinRouter` and :class:`~modeswitch.cluster.baseline.PrefixAffinityBaseline` (Ray's
``PrefixCacheAffinityRouter``) are the baselines the cluster benchmark compares it with. All of them honour a
pinned replica (:class:`Pinning`), which is how the ingress asks every replica for its ``/v1/modes`` and
``/metrics``.
"""

from __future__ import annotations

import hashlib
import random
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import directory
from .directory import replica_name
from .prefixes import BLOCK_CHARS, block_hashes, matched_blocks
from .wire import Forwarded

#: a replica's prefix summary lags by one stats period; what this router sent is trusted this long meanwhile
HINT_TTL_S = 10.0
#: what a prefix hit on the whole prompt is worth, in queued requests (``--prefix-weight``'s default)
PREFIX_WEIGHT = 4.0


def forwarded(pending: PendingRequest | None) -> Forwarded | None:
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg if isinstance(arg, Forwarded) else None


class Pinning:
    """Mixin for every router here: a request that names a replica goes there and nowhere else, and the
    directory follows the replica set."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        directory.DIRECTORY.attach(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        req = forwarded(pending_request)
        if req is not None and req.replica is not None:
            return [[r for r in candidate_replicas if replica_name(r) == req.replica]]
        return await self.place(candidate_replicas, pending_request)


class RoundRobinRouter(Pinning, RequestRouter):
    """Each request to the next replica in a fixed order, whatever it holds (the benchmark's floor)."""

    def initialize_state(self, **kwargs) -> None:
        self._turn = 0

    async def place(self, candidates: list[RunningReplica], pending: PendingRequest | None):
        if not candidates:
            return []
        ordered = sorted(candidates, key=replica_name)
        first = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[first:] + ordered[:first]]


def home_rank(first_block: int, replica: RunningReplica) -> int:
    """Rendezvous (highest random weight) hashing of a prompt's first block over replicas: every router
    computes the same home for a prefix, and removing a replica moves only the prefixes homed on it."""
    digest = hashlib.blake2b(f"{first_block}:{replica_name(replica)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class ModeSwitchRouter(Pinning, RequestRouter):
    """Scores every replica for this request and ranks them best first.

    score = ``prefix_weight`` x (fraction of the prompt whose prefix the replica holds) - (its queue)

    - prefix: the replica's published block hashes (:mod:`modeswitch.cluster.prefixes`) plus what this router
      sent it in the last :data:`HINT_TTL_S` seconds (its stats lag by one period).
    - queue: the requests this router has placed there and not seen finish, counted from the moment it ranks
      the replica first (Serve's own queue-length cache is bumped only after the caller resumes, so a burst of
      requests would all see the same empty replica); the larger of that and the replica's own waiting +
      running count (other ingresses' traffic).
    - replicas whose stats say no mode is available, or that memory is below ``min_headroom``, are ranked
      last (never dropped: a stale report must not strand a request).
    - ties (e.g. a prefix no replica holds yet, equal queues) go to the prompt's home replica: the one its first
      block hashes to (rendezvous hashing), so the next requests of a new group find it there and groups
      spread over replicas evenly; then to the lower running J/token, then at random.

    With the default weight a replica holding three quarters of the prompt keeps the request until it has
    three more requests in flight than the least loaded one. It was chosen with ``benchmarks/cluster.py``
    (groups of prompts sharing most of their tokens): against a lower weight it raised the prefix hit rate and
    kept the replicas' loads equal.
    """

    def initialize_state(self, prefix_weight: float = PREFIX_WEIGHT, min_headroom: float = 0.02, **kwargs) -> None:
        self._prefix_weight = prefix_weight
        self._min_headroom = min_headroom
        self._hints: dict[ReplicaID, dict[int, float]] = {}
        self._held: dict[ReplicaID, tuple[object, frozenset[int]]] = {}
        #: request id -> the replica it was ranked first on (until Serve says where it went)
        self._tentative: dict[str, ReplicaID] = {}
        #: request id -> the replica serving it (until it completes)
        self._placed: dict[str, ReplicaID] = {}

    def _held_blocks(self, replica: RunningReplica) -> frozenset[int]:
        """The replica's published blocks as a set, rebuilt only when its stats change."""
        blocks = (replica.routing_stats or {}).get("prefix_blocks", ())
        cached = self._held.get(replica.replica_id)
        if cached is None or cached[0] is not blocks:
            cached = (blocks, frozenset(blocks))
            self._held[replica.replica_id] = cached
        return cached[1]

    def _queue(self, replica: RunningReplica) -> float:
        rid = replica.replica_id
        mine = sum(1 for r in self._placed.values() if r == rid) + sum(1 for r in self._tentative.values()
                                                                       if r == rid)
        stats = replica.routing_stats or {}
        return max(mine, stats.get("waiting", 0) + stats.get("running", 0))

    def _healthy(self, replica: RunningReplica) -> bool:
        stats = replica.routing_stats or {}
        if not stats:
            return True
        return bool(stats.get("modes")) and stats.get("headroom", 1.0) >= self._min_headroom

    def score(self, replica: RunningReplica, hashes: list[int], length: int, now: float) -> float:
        held = self._held_blocks(replica)
        hints = self._hints.get(replica.replica_id, {})

        def holds(h: int) -> bool:  # only this prompt's blocks are looked up: the hints can number thousands
            sent = hints.get(h)
            return h in held or (sent is not None and now - sent < HINT_TTL_S)

        blocks = matched_blocks(hashes, holds)
        return self._prefix_weight * (blocks * BLOCK_CHARS / length if length else 0.0) - self._queue(replica)

    async def place(self, candidates: list[RunningReplica], pending: PendingRequest | None):
        req = forwarded(pending)
        text = req.prompt if req is not None else ""
        hashes = block_hashes(text)
        now = time.monotonic()
        keyed = []
        for r in candidates:
            j = (r.routing_stats or {}).get("j_per_token")
            keyed.append((not self._healthy(r), -self.score(r, hashes, len(text), now),
                          -home_rank(hashes[0], r) if hashes else 0, j if j is not None else float("inf"),
                          random.random(), r))
        keyed.sort(key=lambda k: k[:5])
        if keyed and pending is not None:
            self._tentative[pending.metadata.internal_request_id] = keyed[0][-1].replica_id
        return [[k[-1]] for k in keyed]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        self._tentative.pop(request_id, None)
        self._placed[request_id] = replica_id
        req = forwarded(pending_request)
        if req is None or not req.prompt:
            return
        now = time.monotonic()
        hints = self._hints.setdefault(replica_id, {})
        for h in block_hashes(req.prompt):
            hints[h] = now
        if len(hints) > 4096:  # drop what has expired; the replica's summary has it by now
            self._hints[replica_id] = {h: t for h, t in hints.items() if now - t < HINT_TTL_S}

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._placed.pop(internal_request_id, None)
        self._tentative.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._hints.pop(replica_id, None)
        self._held.pop(replica_id, None)
        for table in (self._placed, self._tentative):
            for request_id in [k for k, r in table.items() if r == replica_id]:
                del table[request_id]


#: --router name -> import path of the router class (Serve imports it in the ingress process)
ROUTERS = {"modeswitch": "modeswitch.cluster.routing.ModeSwitchRouter",
           "round_robin": "modeswitch.cluster.routing.RoundRobinRouter",
           "prefix_affinity": "modeswitch.cluster.baseline.PrefixAffinityBaseline"}
