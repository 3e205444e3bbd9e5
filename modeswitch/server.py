"""Command line: parse flags into a ServerConfig, assemble the server (modeswitch.compose), serve it with
waitress (threaded WSGI), handle signals."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import replace

from . import logs
from .compose import build_app
from .config import ServerConfig, add_server_flags, read_server_flags
from .device import cap_kernels, keep_heap_trimmed
from .evals.behind import score_behind
from .memory import MemoryBudgetExceeded
from .weights.presets import WeightsNotFound
from .yamlconf import ConfigError

log = logging.getLogger("modeswitch")


def build_parser() -> argparse.ArgumentParser:
    """The flags of every :class:`ServerConfig` field (defaults and help from the config, see
    :func:`modeswitch.config.add_server_flags`), and what this command does once the modes are up."""
    p = argparse.ArgumentParser(prog="serve.py", description="ModeSwitch: one model, many inference modes, "
                                "a mode chosen per request. OpenAI-compatible HTTP API.")
    add_server_flags(p)
    p.add_argument("--exit-when-ready", action="store_true",
                   help="load every mode, then exit 0 instead of serving: fills the compile caches, so that the "
                        "next start loads compiled kernels (make setup runs it)")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The configuration of parsed flags; ``--exit-when-ready`` loads every mode before it exits (no staged start)."""
    config = read_server_flags(args)
    if args.exit_when_ready:
        config = replace(config, load=replace(config.load, staged=False))
    return config


def claim_port(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the models load; it listens once they have. A port in use fails at once
    instead of after minutes of loading, and nothing the start-up runs can take the port meanwhile: vLLM's
    engines open ports of their own, and one could take the port the server is about to listen on."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress does: a restart reuses the port
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None, backend=None) -> int:
    """Serve until SIGTERM (drained) or Ctrl-C. ``backend``: the engine family to use instead of the one
    ``--backend`` selects (the test double of :mod:`modeswitch.testing` runs the real server this way)."""
    args = build_parser().parse_args(argv)
    cap_kernels()  # before anything computes: the libraries read their caps once
    config = config_from_args(args)
    logs.configure(config.log_level, config.verbose)
    started = time.perf_counter()
    try:
        listener = claim_port(config.http.host, config.http.port)
    except OSError as exc:
        print(f"error: cannot listen on {config.http.host}:{config.http.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        assembled = build_app(config, backend=backend)
    except (WeightsNotFound, ConfigError, MemoryBudgetExceeded) as exc:
        listener.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keep_heap_trimmed()
    if args.exit_when_ready:
        log.info("ready in %.1f s; exiting (--exit-when-ready)", time.perf_counter() - started)
        listener.close()
        assembled.close()
        return 0
    from waitress import create_server

    http, service, admission = assembled.config.http, assembled.service, assembled.admission

    def on_sighup(signum, frame):
        try:
            policy = service.controller.reload()
            log.info("SIGHUP: policy reloaded: %s", policy.name)
        except ConfigError as exc:
            log.error("SIGHUP: policy not changed: %s", exc)

    def on_sigterm(signum, frame):
        """Stop admitting, let in-flight requests finish (a thread waits), then leave the serving loop."""
        log.info("SIGTERM: draining %d request(s), up to %.0f s", admission.active, http.drain_timeout)

        def drain_then_exit():
            drained = admission.drain(http.drain_timeout)
            log.info("drained" if drained else "drain timeout: exiting with requests in flight")
            signal.raise_signal(signal.SIGUSR1)

        threading.Thread(target=drain_then_exit, name="drain", daemon=True).start()

    def on_sigusr1(signum, frame):
        raise SystemExit(0)  # waitress's loop shuts its task threads down on SystemExit

    signal.signal(signal.SIGHUP, on_sighup)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGUSR1, on_sigusr1)
    server = create_server(assembled.app, sockets=[listener], threads=http.threads, channel_timeout=600)
    scorer = score_behind(assembled)
    available = ", ".join(m.name for m in service.registry.available())
    loading = ", ".join(m.name for m in service.registry.loading())
    log.info("ready in %.1f s: model %s, modes available: %s%s; listening on http://%s:%s",
             time.perf_counter() - started, service.model_name, available,
             f" (loading: {loading})" if loading else "", http.host, server.effective_port)
    try:
        server.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if scorer is not None:
            scorer.stop()
        server.close()
        assembled.close()
    log.info("stopped")
    return 0
