"""What the server and its engine processes print: ModeSwitch's own progress at ``--log-level``; the engine
libraries' (vLLM, torch, torchao) warnings and errors only, unless ``--verbose``.

A start printed each vLLM engine's multi-kilobyte config dump, torchao's failed loads of CUDA kernels on a CPU,
torch's deprecation notices and vLLM's load progress bars, several times over (each engine process imports them
again), and the server's own progress lines were lost among them. vLLM's engine processes are spawned: they
inherit the environment, not this process's logging, so the signal they read is vLLM's own
``VLLM_LOGGING_LEVEL`` (set here unless it is set), and :func:`quiet_libraries` runs in each of them too (from
``serve.py``, which a spawned process imports first, and from the vLLM plugin).
"""

from __future__ import annotations

import logging
import os
import warnings

#: vLLM's own variable for its log level; the engine processes read it
LEVEL_ENV = "VLLM_LOGGING_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str = "info", verbose: bool = False) -> None:
    """This process logs ModeSwitch at ``level``; the engine libraries here and in every engine process started
    from now on at WARNING (INFO with ``verbose``)."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    logging.getLogger("modeswitch").setLevel(level.upper())
    os.environ.setdefault(LEVEL_ENV, "INFO" if verbose else "WARNING")
    quiet_libraries()


def quiet_libraries() -> None:
    """Unless the engine libraries are to log at INFO or below (``LEVEL_ENV``, WARNING when unset): vLLM at
    WARNING, and three sources of noise that say nothing about this server to ERROR: torchao's CUDA kernels it
    cannot load on a CPU, torch's notices about torchao's pytree registrations, the deprecations vLLM's code
    triggers. Idempotent."""
    level = os.environ.get(LEVEL_ENV, "WARNING").upper()
    if level not in ("WARNING", "ERROR", "CRITICAL"):
        return
    logging.getLogger("vllm").setLevel(level)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    # one line per tensor when a checkpoint's fp32 norms load into a bf16 engine (the W8A8 one): a cast
    loader = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, _DtypeCasts) for f in loader.filters):
        loader.addFilter(_DtypeCasts())


class _DtypeCasts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Attempted to load weight")


def libraries_verbose() -> bool:
    """Whether the engine libraries show INFO (their progress bars too)."""
    return logging.getLogger("vllm").isEnabledFor(logging.INFO)
