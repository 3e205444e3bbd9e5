"""The server's configuration as data: one typed object built from the command line (or by a caller).

Everything that assembles a server — ``serve.py``, the lm-eval adapter, the benchmarks, the tests — builds a
:class:`ServerConfig` and hands it to the composition root; nothing else reads ``argparse`` namespaces or
keyword soups. The parts are split by who reads them: :class:`LoadConfig` is what the mode registry needs to
plan and load modes, :class:`HttpConfig` what the HTTP layer needs, and the rest names the model, its modes,
the policy and the quality gate report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("transformers", "vllm", "auto")
DECODE_PATHS = ("auto", "compiled", "eager")
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: ``gate_report`` value that turns the quality gate off.
NO_GATE = "none"


@dataclass(frozen=True)
class LoadConfig:
    """How the modes are planned and loaded (read by the mode registry and its backends)."""

    engine: str = "transformers"
    device: str = "auto"
    dtype: str = "auto"
    #: bytes all modes may use; None: free device memory minus a headroom
    memory_budget: int | None = None
    max_model_len: int = 8192
    decode: str = "auto"
    #: power assumed by the energy estimate where no energy counter exists (None: the device's default)
    power_watts: float | None = None
    #: serve as soon as the modes a plain request goes to are up (the engine holding the policy's first mode),
    #: and load the others in the background; False: serve once every mode is up
    staged: bool = False
    #: seconds a staged start's later engines yield the CPU to the requests served (started under SCHED_IDLE,
    #: see ``modeswitch.priority``) before competing for it; 0: they compete from the start
    yield_start_s: float = 300.0


@dataclass(frozen=True)
class HttpConfig:
    """How the HTTP server listens and whom it serves."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 32
    api_key: str | None = None
    max_inflight_per_client: int = 16
    drain_timeout: float = 60.0
    #: serve the admin routes without an API key on a non-loopback bind (off: they answer 403 there)
    unauthenticated_admin: bool = False
    #: the name this server answers as in a cluster (``modeswitch.replica``, ``X-ModeSwitch-Replica``)
    replica: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    """One served model: its weights, the modes to load, the policy that routes, the gate that filters."""

    model: str = "demo"
    #: GPTQ checkpoint overriding the preset's (hub id or path)
    gptq: str | None = None
    #: W8A8 int8 checkpoint overriding the preset's (hub id or path): what vLLM engines serve as INT8
    w8a8: str | None = None
    #: directories of mode files; empty: the modes shipped with the package
    modes_dirs: tuple[Path, ...] = ()
    #: the subset of defined modes to load; empty: all
    modes: tuple[str, ...] = ()
    #: policy file; None: the shipped paper policy
    policy: Path | None = None
    #: quality gate report; None: the shipped report for this model if there is one; ``NO_GATE``: off
    gate_report: str | None = None
    #: further directories the admin routes may load policies and gate reports from (besides the policy's,
    #: the gate report's and the shipped ones)
    admin_dirs: tuple[Path, ...] = ()
    load: LoadConfig = field(default_factory=LoadConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
