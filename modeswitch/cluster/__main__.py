"""``python -m modeswitch.cluster --replicas N [serve.py flags]``: start (or join) a Ray cluster, deploy the
ModeSwitch application on it, serve until SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from .. import logs
from ..memory import MemoryBudgetExceeded
from ..weights.presets import WeightsNotFound
from ..yamlconf import ConfigError
from .app import application, cluster_parser, config_from_cluster_args

log = logging.getLogger("modeswitch.cluster")


def main(argv: list[str] | None = None) -> int:
    args = cluster_parser().parse_args(argv)
    try:
        config = config_from_cluster_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.server.log_level, config.server.verbose)
    import ray
    from ray import serve

    ray.init(address=config.address)
    http = config.server.http
    serve.start(http_options={"host": http.host, "port": http.port})
    try:
        serve.run(application(config), name="modeswitch", route_prefix="/")
    except (WeightsNotFound, ConfigError, MemoryBudgetExceeded, RuntimeError) as exc:
        print(f"error: replicas did not start: {exc}", file=sys.stderr)
        serve.shutdown()
        return 2
    log.info("ready: %d replica(s), router %s; listening on http://%s:%s", config.replicas, config.router,
             http.host, http.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    log.info("shutting down (replicas drain up to %.0f s)", http.drain_timeout)
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
