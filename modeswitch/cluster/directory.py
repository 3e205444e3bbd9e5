"""The live set of replicas, as the request router in this process sees them.

Serve builds the router inside the process that holds the deployment handle (the ingress) and tells it of every
replica change and every replica's routing stats; the ingress reads the same set here to fan ``/v1/modes`` and
``/metrics`` out and to answer 503 at once when no replica is up.

A module of its own, reached as ``directory.DIRECTORY``: Serve ships the router class to the ingress with
cloudpickle, which may copy a class's module globals by value, but always refers to a module by its name, so
both sides find the one instance here.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import RequestRouter, RunningReplica


def replica_name(replica: RunningReplica) -> str:
    """The name a replica reports as ``modeswitch.replica``: Serve's unique id of the replica."""
    return replica.replica_id.unique_id


class ReplicaDirectory:
    """The router's replicas and their latest routing stats (read live: Serve updates them in place)."""

    def __init__(self) -> None:
        self._router: RequestRouter | None = None

    def attach(self, router: RequestRouter) -> None:
        self._router = router

    @property
    def attached(self) -> bool:
        return self._router is not None

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Replica name -> its latest routing stats ({} until it has published any)."""
        if self._router is None:
            return {}
        return {replica_name(r): dict(r.routing_stats or {}) for r in list(self._router.curr_replicas.values())}


#: the directory of this process (one ingress holds one handle to the replica deployment)
DIRECTORY = ReplicaDirectory()
