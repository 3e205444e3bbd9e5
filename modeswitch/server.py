"""Command line: parse flags into a ServerConfig, assemble the server (modeswitch.compose), serve it with
waitress (threaded WSGI), handle signals."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from .compose import build_app
from .config import DECODE_PATHS, DTYPES, ENGINES, HttpConfig, LoadConfig, ServerConfig
from .memory import MemoryBudgetExceeded, parse_bytes
from .models import PRESETS, WeightsNotFound
from .yamlconf import ConfigError

log = logging.getLogger("modeswitch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description="ModeSwitch: one model, many inference modes, "
                                "a mode chosen per request. OpenAI-compatible HTTP API.")
    p.add_argument("--model", default="demo",
                   help=f"preset ({', '.join(PRESETS)}) or any Llama-family causal LM as hub id or local path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default=None, help="policy YAML (default: the shipped policies/batch-first.yaml)")
    p.add_argument("--engine", default="auto", choices=ENGINES,
                   help="auto (default: vLLM where it is installed, else transformers), vllm (vLLM engines, modes "
                        "mapped onto the fewest), or transformers (in-process, portable)")
    p.add_argument("--modes-dir", action="append", default=None,
                   help="directory of mode definitions (repeatable; default: the shipped modes/). "
                        "modes/extra holds the speculative variants")
    p.add_argument("--modes", default=None, help="comma-separated subset of modes to load (default: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="dtype of the reference weights (auto: the device's native 16-bit type: bf16 on GPUs and CPUs that "
                        "have it, fp16 on GPUs without bf16, fp32 on CPUs without native bf16)")
    p.add_argument("--memory-budget", default=None,
                   help="bytes all modes may use, e.g. 12GiB (default: free device memory minus 10%%)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="longest prompt + output served (caps the model's context; sizes KV reservations)")
    p.add_argument("--decode", default="auto", choices=DECODE_PATHS,
                   help="compiled: every one-at-a-time mode on the owned static-cache loop, compiled (CUDA graphs "
                        "on a GPU), and CUDA graphs for continuous batching; on vLLM engines, vLLM's compiled model; "
                        "eager: generate() / vLLM's eager model; auto: compiled on GPUs and on vLLM engines (vLLM's "
                        "own default), eager on the transformers engine on a CPU")
    p.add_argument("--staged-start", action=argparse.BooleanOptionalAction, default=True,
                   help="serve as soon as the engine of the policy's first mode is up and load the other modes in "
                        "the background (/health counts them in modes_loading; /v1/modes lists them as loading); "
                        "--no-staged-start: listen once every mode is up")
    p.add_argument("--yield-start-s", type=float, default=300.0,
                   help="with a staged start on vLLM engines: seconds the engines starting in the background yield "
                        "the CPU to the requests served (Linux SCHED_IDLE, where the process may return from it) "
                        "before competing for it; 0: they compete from the start")
    p.add_argument("--exit-when-ready", action="store_true",
                   help="load every mode, then exit 0 instead of serving: fills the compile caches, so that the "
                        "next start loads compiled kernels (make setup runs it)")
    p.add_argument("--gptq", default=None, help="GPTQ checkpoint (hub id or path) overriding the preset's")
    p.add_argument("--w8a8", default=None,
                   help="W8A8 int8 checkpoint (compressed-tensors; hub id or path) overriding the preset's: INT8 on "
                        "vLLM engines (python -m modeswitch.quantize w8a8 SRC OUT writes one)")
    p.add_argument("--gate-report", default=None,
                   help="quality gate report the router enforces (default: the shipped evals/reports/<model>-<engine>.json "
                        "if it exists; 'none' disables the gate; write one with python -m modeswitch.evals.gate)")
    p.add_argument("--power-watts", type=float, default=None,
                   help="power assumed by the energy estimate where NVML has no energy counter (CPUs, laptops); "
                        "default 65 W on a CPU. Estimates are labelled 'estimated' everywhere")
    p.add_argument("--threads", type=int, default=32, help="HTTP worker threads (streams hold one each)")
    p.add_argument("--api-key", default=os.environ.get("MODESWITCH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (env MODESWITCH_API_KEY)")
    p.add_argument("--max-inflight-per-client", type=int, default=16,
                   help="generation requests one client (API key, else address) may have in flight; 429 beyond "
                        "(0: no limit)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM: seconds to let in-flight requests finish before exiting")
    p.add_argument("--admin-dir", action="append", default=None,
                   help="a further directory POST /admin/policy and /admin/gate may load files from (repeatable; "
                        "always allowed: the --policy and --gate-report directories and the shipped ones)")
    p.add_argument("--unauthenticated-admin", action="store_true",
                   help="serve the admin routes without --api-key on a non-loopback --host (closed otherwise)")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The typed configuration of parsed flags; raises ConfigError for values argparse cannot check."""
    try:
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    except ValueError as exc:
        raise ConfigError(f"--memory-budget: {exc}") from None
    load = LoadConfig(engine=args.engine, device=args.device, dtype=args.dtype, memory_budget=budget,
                      max_model_len=args.max_model_len, decode=args.decode, power_watts=args.power_watts,
                      staged=args.staged_start and not args.exit_when_ready, yield_start_s=args.yield_start_s)
    http = HttpConfig(host=args.host, port=args.port, threads=args.threads, api_key=args.api_key,
                      max_inflight_per_client=args.max_inflight_per_client, drain_timeout=args.drain_timeout,
                      unauthenticated_admin=args.unauthenticated_admin)
    modes = tuple(m.strip() for m in (args.modes or "").split(",") if m.strip())
    return ServerConfig(model=args.model, gptq=args.gptq, w8a8=args.w8a8, modes_dirs=tuple(Path(d) for d in args.modes_dir or ()),
                        modes=modes, policy=Path(args.policy) if args.policy else None,
                        gate_report=args.gate_report, admin_dirs=tuple(Path(d) for d in args.admin_dir or ()),
                        load=load, http=http)


def claim_port(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before the models load; it listens once they have. A port in use fails at once
    instead of after minutes of loading, and nothing the start-up runs can take the port meanwhile: vLLM's
    engines open ports of their own, and a benchmark's server once lost its port to one, 150 s into its start."""
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
    ``--engine`` selects (the test double of :mod:`modeswitch.testing` runs the real server this way)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        listener = claim_port(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        assembled = build_app(config_from_args(args), backend=backend)
    except (WeightsNotFound, ConfigError, MemoryBudgetExceeded) as exc:
        listener.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
        server.close()
        assembled.close()
    log.info("stopped")
    return 0
