"""The cluster's composition: flags -> a Ray Serve application (ingress + N ModeSwitch replicas).

Used by ``python -m modeswitch.cluster`` and, as an application builder, by Ray's own CLI:
``serve run modeswitch.cluster.app:build model=demo replicas=2 backend=transformers`` (every key is a flag of
``python -m modeswitch.cluster`` without its dashes; ``serve build`` writes the matching config file for
``serve deploy``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..config import ServerConfig, add_flags, option, read_flags
from ..server import build_parser, config_from_args
from .routing import PREFIX_WEIGHT, ROUTERS


@dataclass(frozen=True)
class ClusterConfig:
    """How the replicas are laid out and routed; each replica serves ``server`` (one ModeSwitch server)."""

    server: ServerConfig
    replicas: int = option(2, "ModeSwitch servers (one per GPU on GPUs)")
    router: str = option("modeswitch", "modeswitch (prefix-, load- and gate-aware), round_robin, or prefix_affinity "
                         "(Ray's PrefixCacheAffinityRouter)", choices=sorted(ROUTERS))
    num_cpus: float | None = option(None, "logical CPUs per replica (default: an equal share of the cluster's CPUs "
                                    "without GPUs)", flag="--replica-cpus")
    num_gpus: float | None = option(None, "GPUs per replica (default: 1 where GPUs exist)", flag="--replica-gpus")
    address: str | None = option(None, "Ray cluster to join (e.g. ray://head:10001; default: start a local one)")
    max_ongoing: int = option(64, "requests one replica may hold (Serve queues the rest at the router)")
    stats_period_s: float = option(1.0, "seconds between replicas' routing stats", flag="--stats-period")
    request_timeout_s: float = option(600.0, "seconds a request may wait for a replica's first byte before a 503",
                                      flag="--request-timeout")
    prefix_weight: float = option(PREFIX_WEIGHT, "modeswitch router: what a prefix hit on the whole prompt is worth, "
                                  "in queued requests (higher: more prefix affinity, less load balance)")


def cluster_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "python -m modeswitch.cluster"
    p.description = ("ModeSwitch replicas behind Ray Serve: one OpenAI-compatible endpoint, each request sent to "
                     "the replica that serves it best, whose controller then picks the mode. Server flags as "
                     "for serve.py.")
    add_flags(p, ClusterConfig, "cluster.")
    return p


def config_from_cluster_args(args: argparse.Namespace) -> ClusterConfig:
    config = ClusterConfig(server=config_from_args(args), **read_flags(args, ClusterConfig, "cluster."))
    if config.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    return config


def replica_resources(config: ClusterConfig) -> tuple[float, float]:
    """(CPUs, GPUs) per replica: as configured, else one GPU each where the Ray cluster has GPUs, else an
    equal share of its CPUs (logical: Ray does not pin cores, it only keeps the sum within the machine)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=config.address)
    total = ray.cluster_resources()
    gpus = config.num_gpus if config.num_gpus is not None else (1.0 if total.get("GPU", 0) >= 1 else 0.0)
    cpus = config.num_cpus
    if cpus is None:
        cpus = 1.0 if gpus else max(0.1, round(total.get("CPU", 1.0) / config.replicas, 2))
    return cpus, gpus


def application(config: ClusterConfig, backend=None):
    """The Serve application: the ingress bound to the replica deployment. ``backend`` replaces the engine
    family in every replica (the fake backend of :mod:`modeswitch.testing`, for tests)."""
    from ray.serve.config import RequestRouterConfig

    from .ingress import Ingress
    from .replica import Replica

    cpus, gpus = replica_resources(config)
    router = RequestRouterConfig(
        request_router_class=ROUTERS[config.router],
        request_router_kwargs={"prefix_weight": config.prefix_weight} if config.router == "modeswitch" else {},
        request_routing_stats_period_s=config.stats_period_s, request_routing_stats_timeout_s=10)
    replica = Replica.options(num_replicas=config.replicas, max_ongoing_requests=config.max_ongoing,
                              ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
                              graceful_shutdown_timeout_s=config.server.http.drain_timeout,
                              request_router_config=router)
    return Ingress.bind(replica.bind(config.server, backend), config.request_timeout_s)


def build(args: dict[str, str]):
    """Ray Serve application builder (``serve run modeswitch.cluster.app:build key=value ...``)."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value in (True, "true", "") else [flag, str(value)]
    return application(config_from_cluster_args(cluster_parser().parse_args(argv)))
