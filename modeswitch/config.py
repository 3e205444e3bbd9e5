"""The server's configuration as data: one typed object, and the single source of every default.

Everything that assembles a server — ``serve.py``, the lm-eval adapter, the benchmarks, the tests — builds a
:class:`ServerConfig` and hands it to the composition root; nothing else reads ``argparse`` namespaces or
keyword soups. The parts are split by who reads them: :class:`LoadConfig` is what the mode registry needs to
plan and load modes, :class:`HttpConfig` what the HTTP layer needs, and the rest names the model, its modes,
the policy and the quality gate report.

Each field that a user sets is declared with :func:`option`: its default and its help text live here, and
:func:`add_arguments` derives the command line from the fields (as vLLM derives its CLI from ``EngineArgs``),
so ``serve.py --help`` and ``ServerConfig()`` cannot disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .controller.costs import REMEASURE_IDLE_S
from .memory import parse_bytes
from .weights.presets import PRESETS

BACKENDS = ("transformers", "vllm", "auto")
DECODE_PATHS = ("auto", "compiled", "eager")
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: ``gate_report`` value that turns the quality gate off.
NO_GATE = "none"
#: where ``--api-key`` is read from when the flag is not given (keeps the key out of the process list)
API_KEY_ENV = "MODESWITCH_API_KEY"


def option(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
           **argparse_kwargs: Any) -> Any:
    """A configuration field that is also a command-line flag (``--<name>`` unless ``flag``): its default and its
    help in one place. ``parse`` turns the flag's text into the field's value (e.g. ``12GiB`` into bytes)."""
    return field(default=default, metadata={"help": help, "flag": flag, "parse": parse, "argparse": argparse_kwargs})


def _memory_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


@dataclass(frozen=True)
class LoadConfig:
    """How the modes are planned and loaded (read by the mode registry and its backends)."""

    backend: str = option("auto", "auto (vLLM where it is installed, the modes it has no kernel for on this machine "
                         "on transformers; else transformers), vllm (vLLM engines only, modes mapped onto the fewest), "
                         "or transformers (in-process, portable)", choices=BACKENDS)
    device: str = option("auto", "auto, cpu, cuda, cuda:1, ...")
    dtype: str = option("auto", "dtype of the reference weights (auto: the device's native 16-bit type: bf16 on GPUs "
                        "and CPUs that have it, fp16 on GPUs without bf16, fp32 on CPUs without native bf16)",
                        choices=DTYPES)
    memory_budget: int | None = option(None, "bytes all modes may use, e.g. 12GiB (default: free device memory "
                                       "minus 10%%)", parse=_memory_size)
    max_model_len: int = option(8192, "longest prompt + output served (caps the model's context; sizes KV "
                                "reservations)")
    decode: str = option("auto", "compiled: every one-at-a-time mode on the owned static-cache loop, compiled (CUDA "
                         "graphs on a GPU), and CUDA graphs for continuous batching; on vLLM engines, vLLM's compiled "
                         "model; eager: generate() / vLLM's eager model; auto: compiled on GPUs and on vLLM engines "
                         "(vLLM's own default), eager on the transformers engine on a CPU", choices=DECODE_PATHS)
    power_watts: float | None = option(None, "power assumed by the energy estimate where NVML has no energy counter "
                                       "(CPUs, laptops); default 65 W on a CPU. Estimates are labelled 'estimated' "
                                       "everywhere")
    staged: bool = option(True, "serve as soon as the engine of the policy's first mode is up and load the other "
                          "modes in the background (/health counts them in modes_loading; /v1/modes lists them as "
                          "loading); --no-staged-start: listen once every mode is up", flag="--staged-start")
    engine_stall_s: float = option(60.0, "seconds one engine step may run before the engine counts as wedged: "
                                   "its requests are answered at once; a vLLM engine is killed and started again, "
                                   "as a dead one is; a transformers engine gets a new worker thread once the "
                                   "step has returned (0: never)")
    crash_loop_deaths: int = option(5, "an engine that dies is started again at once, each time; more than this "
                                    "many deaths (failed starts included) within --crash-loop-window-s is a crash "
                                    "loop: its modes are unavailable, with the reason, until --crash-loop-backoff-s "
                                    "has passed, and then it is started again")
    crash_loop_window_s: float = option(600.0, "seconds over which an engine's deaths count towards a crash loop")
    crash_loop_backoff_s: float = option(120.0, "seconds a crash-looping engine waits before it is started again, "
                                         "doubling with each crash loop in a row up to --crash-loop-backoff-max-s")
    crash_loop_backoff_max_s: float = option(1800.0, "the longest wait of a crash-looping engine")
    yield_start_s: float = option(300.0, "with a staged start on vLLM engines, and for an engine compiled again "
                                  "after it came back eager from a death: seconds the engines starting in the "
                                  "background yield the CPU to the requests served (Linux SCHED_IDLE, where the "
                                  "process may return from it) before competing for it; 0: they compete from the start")


@dataclass(frozen=True)
class HttpConfig:
    """How the HTTP server listens and whom it serves."""

    host: str = option("127.0.0.1", "address to bind (loopback: this machine only)")
    port: int = option(8000, "port to listen on (0: any free port)")
    threads: int = option(32, "HTTP worker threads (streams hold one each)")
    api_key: str | None = option(None, f"require 'Authorization: Bearer KEY' on every route but /health (read from "
                                 f"${API_KEY_ENV} when the flag is not given)")
    max_inflight_per_client: int = option(16, "generation requests one client (API key, else address) may have in "
                                          "flight; 429 beyond (0: no limit)")
    drain_timeout: float = option(60.0, "on SIGTERM: seconds to let in-flight requests finish before exiting")
    unauthenticated_admin: bool = option(False, "serve the admin routes without --api-key on a non-loopback --host "
                                         "(they answer 403 there otherwise)")
    #: the name this server answers as in a cluster (``modeswitch.replica``, ``X-ModeSwitch-Replica``); set by the
    #: cluster, not a flag
    replica: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    """One served model: its weights, the modes to load, the policy that routes, the gate that filters."""

    model: str = option("demo", f"preset ({', '.join(PRESETS)}) or any Llama-family causal LM as hub id or local path")
    gptq: str | None = option(None, "GPTQ checkpoint (hub id or path) overriding the preset's")
    w8a8: str | None = option(None, "W8A8 int8 checkpoint (compressed-tensors; hub id or path) overriding the preset's: "
                              "INT8 on vLLM engines (python -m modeswitch.weights.quantize w8a8 SRC OUT writes one)")
    modes_dirs: tuple[Path, ...] = option((), "directory of mode definitions (repeatable; default: the shipped modes/). "
                                          "modes/extra holds the speculative variants", flag="--modes-dir",
                                          action="append", type=Path)
    modes: tuple[str, ...] = option((), "comma-separated subset of modes to load (default: all)", parse=_names)
    policy: Path | None = option(None, "policy YAML (default: the shipped policies/fastest.yaml)", parse=Path)
    gate_report: str | None = option(None, "quality gate report the router enforces (default: the shipped "
                                     "evals/reports/<model>-<backend>.json if it exists; 'none' disables the gate; "
                                     "write one with python -m modeswitch.evals.gate)")
    admin_dirs: tuple[Path, ...] = option((), "a further directory POST /admin/policy and /admin/gate may load files "
                                          "from (repeatable; always allowed: the --policy and --gate-report "
                                          "directories and the shipped ones)", flag="--admin-dir", action="append",
                                          type=Path)
    calibrate: bool = option(True, "measure each engine's prefill and step costs once its modes are up, behind the "
                             "requests (kept per machine, model and engine in the cache's costs.json, so a restart "
                             "reuses them); every finished request corrects them either way. A policy with "
                             "'order: predicted' orders modes by these measurements, and a mode's engine of its own "
                             "(own_engine) goes to the weights an earlier run measured fastest here; without it the "
                             "mode files decide the layout")
    remeasure_idle_s: float = option(REMEASURE_IDLE_S, "seconds an engine idle by measurement (slower at every load "
                                     "than another on its cores: it serves no request that would correct its "
                                     "curves) keeps them before the calibration measures it again, at a moment its "
                                     "cores are quiet (0: never)")
    score_pending: bool = option(True, "score the modes whose quality verdict is pending (their gate report rows were "
                                 "scored on other kernels) on this machine's kernels, through this server's engines "
                                 "once every mode is up: one request at a time, each sent only while no other "
                                 "request is in flight. The run is kept in the cache's gate/ directory under the "
                                 "report's name, so a restart on the same kernels finds it; the verdict replaces "
                                 "'pending' when it is in. --no-score-pending: they stay pending (served only when "
                                 "pinned) until a gate run on this machine is added to the report")
    costs_file: Path | None = option(None, "JSON file the measured costs are kept in across restarts (default: "
                                     "costs.json in the model cache, $MODESWITCH_CACHE or ~/.cache/modeswitch)",
                                     parse=Path)
    log_level: str = option("info", "what ModeSwitch itself logs", choices=("debug", "info", "warning", "error"))
    verbose: bool = option(False, "log the engines' own INFO lines too (vLLM's config dumps and progress bars, "
                           "torch's notices); otherwise they log warnings and errors only")
    load: LoadConfig = field(default_factory=LoadConfig)
    http: HttpConfig = field(default_factory=HttpConfig)


def _flags(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One flag per :func:`option` field of ``cls``, in a group named after it; its default and help read from
    the field. ``prefix`` keeps the parsed values of one section apart (``load.backend``)."""
    group = parser.add_argument_group(cls.__name__, (cls.__doc__ or "").strip())
    for f in _flags(cls):
        meta = f.metadata
        kwargs: dict[str, Any] = {"dest": prefix + f.name, **meta["argparse"]}
        kind = f.type.split(" |")[0]
        appends = kwargs.get("action") == "append"
        # argparse appends to a given default: the field's () is applied after parsing (read_flags)
        default = None if appends else f.default
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" not in kwargs:
            name = (meta["flag"] or f.name).lstrip("-").replace("-", "_").upper()
            kwargs.setdefault("metavar", name.removesuffix("S") if appends else name)
        if meta["parse"] is not None:
            kwargs["type"] = meta["parse"]
        elif kind in ("int", "float") and "type" not in kwargs:
            kwargs["type"] = {"int": int, "float": float}[kind]
        shown = f.default if not isinstance(f.default, tuple) else ",".join(map(str, f.default))
        help_text = meta["help"] + ("" if f.default in (None, ()) else f" (default: {shown})")
        group.add_argument(meta["flag"] or "--" + f.name.replace("_", "-"), default=default, help=help_text, **kwargs)


def read_flags(args: argparse.Namespace, cls: type, prefix: str = "") -> dict[str, Any]:
    """The values of ``cls``'s flags (added by :func:`add_flags` with the same ``prefix``), as its fields."""
    values = {}
    for f in _flags(cls):
        value = getattr(args, prefix + f.name)
        values[f.name] = tuple(value or ()) if f.metadata["argparse"].get("action") == "append" else value
    return values


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of a :class:`ServerConfig`: its own, its load section's, its HTTP section's."""
    add_flags(parser, ServerConfig)
    add_flags(parser, LoadConfig, "load.")
    add_flags(parser, HttpConfig, "http.")


def read_server_flags(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerConfig:
    """The configuration of flags parsed by a parser :func:`add_server_flags` built; the API key comes from
    ``environ`` (default ``os.environ``) when its flag is not given."""
    import os

    http = read_flags(args, HttpConfig, "http.")
    http["api_key"] = http["api_key"] or (os.environ if environ is None else environ).get(API_KEY_ENV)
    return ServerConfig(**read_flags(args, ServerConfig), load=LoadConfig(**read_flags(args, LoadConfig, "load.")),
                        http=HttpConfig(**http))
