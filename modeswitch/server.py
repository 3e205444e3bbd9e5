"""Command line: build the mode registry, the controller and the app, then serve them with waitress (threaded WSGI)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .admission import Admission
from .config import LoadConfig
from .controller.decide import Controller
from .controller.rules import load_policy
from .memory import MemoryBudgetExceeded, parse_bytes
from .models import PRESETS, WeightsNotFound, resolve_preset
from .modes import DEFAULT_MODES_DIR, load_modes
from .registry import ModeRegistry
from .service import Service
from .yamlconf import ConfigError

log = logging.getLogger("modeswitch")
DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "paper.yaml"
REPORTS_DIR = Path(__file__).resolve().parent.parent / "evals" / "reports"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.py", description="ModeSwitch: one model, many inference modes, "
                                "a mode chosen per request. OpenAI-compatible HTTP API.")
    p.add_argument("--model", default="demo",
                   help=f"preset ({', '.join(PRESETS)}) or any Llama-family causal LM as hub id or local path")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default=str(DEFAULT_POLICY), help="rule policy YAML (default: policies/paper.yaml)")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm", "auto"],
                   help="transformers (portable, every feature), vllm (vLLM engines, modes mapped onto the fewest), "
                        "or auto (vLLM where installed)")
    p.add_argument("--modes-dir", action="append", default=None,
                   help="directory of mode definitions (repeatable; default: modes/). "
                        "modes/extra holds the speculative variants")
    p.add_argument("--modes", default=None, help="comma-separated subset of modes to load (default: all)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="dtype of the reference weights (auto: bf16/fp16 on GPU, fp32 on CPU)")
    p.add_argument("--memory-budget", default=None,
                   help="bytes all modes may use, e.g. 12GiB (default: free device memory minus 10%%)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="longest prompt + output served (caps the model's context; sizes KV reservations)")
    p.add_argument("--decode", default="auto", choices=["auto", "compiled", "eager"],
                   help="decode path of plain modes: compiled static cache (auto: on GPUs) or eager")
    p.add_argument("--gptq", default=None, help="GPTQ checkpoint (hub id or path) overriding the preset's")
    p.add_argument("--gate-report", default=None,
                   help="quality gate report the router enforces (default: evals/reports/<model>.json if it "
                        "exists; 'none' disables the gate; write one with python -m modeswitch.evals.gate)")
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
    return p


def build_service(args: argparse.Namespace, progress=log.info) -> Service:
    """Everything but the HTTP server; raises WeightsNotFound / ConfigError with a clear message."""
    modes = load_modes(*[Path(d) for d in (args.modes_dir or [DEFAULT_MODES_DIR])])
    defined = [m.name for m in modes]
    if args.modes:
        wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = sorted(set(wanted) - {m.name for m in modes})
        if unknown:
            raise ConfigError(f"--modes: unknown mode(s) {', '.join(unknown)}; defined: {', '.join(m.name for m in modes)}")
        modes = [m for m in modes if m.name in wanted]
    policy = load_policy(args.policy, defined)
    preset = resolve_preset(args.model)
    if args.gptq:
        preset = dataclasses.replace(preset, gptq=args.gptq)
    try:
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    except ValueError as exc:
        raise ConfigError(f"--memory-budget: {exc}") from None
    load = LoadConfig(engine=args.engine, device=args.device, dtype=args.dtype, memory_budget=budget,
                      max_model_len=args.max_model_len, decode=args.decode, power_watts=args.power_watts)
    pool = ModeRegistry(preset, modes, load)
    pool.load(progress)
    progress(f"energy: {pool.energy.source} ({pool.energy.meter.name})")
    controller = Controller(pool, policy, defined_modes=defined)
    report = Path(args.gate_report) if args.gate_report else REPORTS_DIR / f"{Path(args.model).name}.json"
    if args.gate_report != "none" and (args.gate_report or report.is_file()):
        controller.load_quality_report(report)
        progress(f"quality gate: enforcing {report}")
    return Service(pool, controller, preset.name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    try:
        service = build_service(args)
    except (WeightsNotFound, ConfigError, MemoryBudgetExceeded) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from waitress import create_server

    from .api.app import create_app

    def on_sighup(signum, frame):
        try:
            policy = service.controller.reload()
            log.info("SIGHUP: policy reloaded: %s", policy.name)
        except ConfigError as exc:
            log.error("SIGHUP: policy not changed: %s", exc)

    admission = Admission(per_client=args.max_inflight_per_client)

    def on_sigterm(signum, frame):
        """Stop admitting, let in-flight requests finish (a thread waits), then leave the serving loop."""
        log.info("SIGTERM: draining %d request(s), up to %.0f s", admission.active, args.drain_timeout)

        def drain_then_exit():
            drained = admission.drain(args.drain_timeout)
            log.info("drained" if drained else "drain timeout: exiting with requests in flight")
            signal.raise_signal(signal.SIGUSR1)

        threading.Thread(target=drain_then_exit, name="drain", daemon=True).start()

    def on_sigusr1(signum, frame):
        raise SystemExit(0)  # waitress's loop shuts its task threads down on SystemExit

    signal.signal(signal.SIGHUP, on_sighup)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGUSR1, on_sigusr1)
    server = create_server(create_app(service, admission, args.api_key), host=args.host, port=args.port,
                           threads=args.threads, channel_timeout=600)
    available = ", ".join(m.name for m in service.pool.available())
    log.info("ready in %.1f s: model %s, modes available: %s; listening on http://%s:%s",
             time.perf_counter() - started, service.model_name, available, args.host, server.effective_port)
    try:
        server.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.close()
        service.controller.close()
        service.pool.close()
    log.info("stopped")
    return 0
