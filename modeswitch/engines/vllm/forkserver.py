"""The engine-core processes of ModeSwitch's vLLM engines, forked from a process that has imported vLLM already.

vLLM's CPU platform starts every engine-core process with ``spawn``: a fresh interpreter that imports torch and vLLM
again, which on a 2-core CPU is about 10 of the 14.5 s an engine's restart took, and at the first start every engine
imports them at once. Python's ``forkserver`` start method runs one process that imports :data:`PRELOAD` once and
forks each new process from it, the imports done: a restart begins where the spawned process would have ended its
imports, and engines starting together fork from the one import (their pages of it shared until written).

:func:`context` is what vLLM's engine-core process manager starts its processes from in a ModeSwitch server (the
plugin replaces vLLM's ``get_mp_context`` there, through :mod:`.compat`; vLLM's own server keeps ``spawn``). An
:class:`EngineProcess` runs as a spawned one would: a spawned process starts with the environment, CPU affinity and
scheduling policy of the thread that started it, a forked one with the fork server's, so these are taken when the
process starts and set in it before its target runs. What libraries read once at import (OpenMP's ``OMP_*`` when
torch loads, inductor's configuration, vLLM's logging) was read in the fork server, from the environment it started
with: the fork server starts at the first engine's start, after vLLM's platform set its variables, and a process
whose variables of that kind differ from the fork server's is spawned instead. So is every process once the fork
server failed to start: one log line says why, and the engine starts as vLLM starts it.

Threads do not survive a fork, and the fork server starts none: the plugin starts its threads in each engine process
(vLLM loads its plugins there, not at import). A forked process's parent is the fork server, which outlives the
server as long as any of its processes holds its "alive" pipe: an engine process watches the server through
``multiprocessing``'s parent sentinel instead (``plugin.leave_with_parent``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from multiprocessing import context as mp_context

log = logging.getLogger(__name__)

#: what the fork server imports: vLLM's engine core (torch with it), its CPU worker and model runner, and the
#: plugin's modules (loaded, not registered: vLLM registers plugins in each engine process)
PRELOAD = ["vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
           "modeswitch.engines.vllm.plugin"]
#: variables read at import by what the fork server preloads (OpenMP, MKL, glibc's malloc, torch's logging,
#: dynamo's and inductor's configuration, vLLM's logging, the dynamic loader, Python): a process whose values differ
#: from the fork server's is spawned. Not ``PYTORCH_*``: torch reads its allocator's configuration when the
#: allocator starts, in the engine process (``PYTORCH_ALLOC_CONF`` was seen changing between engine starts)
IMPORT_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "LD_", "TORCH", "VLLM_LOGGING_",
               "VLLM_CONFIGURE_LOGGING", "PYTHON")

#: the environment the fork server started with (None: not started); why it is not used (None: it is)
_server_environ: dict[str, str] | None = None
_unusable: str | None = None


def _import_time(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME)}


def _spawn_instead(reason: str) -> None:
    """From now on every engine process is spawned, as vLLM starts it; said once."""
    global _unusable
    if _unusable is None:
        log.warning("vLLM engine processes are spawned, not forked from a preloaded fork server: %s", reason)
    _unusable = reason


class EngineProcess(mp_context.ForkServerProcess):
    """An engine-core process forked from the fork server, set up as a spawned one would be (see the module)."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        self._affinity = os.sched_getaffinity(0)
        self._policy = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority  # sched_param does not pickle
        super().start()

    @staticmethod
    def _Popen(process_obj):
        from multiprocessing import popen_forkserver, popen_spawn_posix

        if _unusable is None and _import_time(process_obj._environ) != _import_time(_server_environ or {}):
            changed = sorted(set(_import_time(process_obj._environ).items())
                             ^ set(_import_time(_server_environ or {}).items()))
            log.warning("vLLM engine process spawned, not forked: variables read at import changed since the fork "
                        "server started (%s)", ", ".join(sorted({k for k, _ in changed})))
            return popen_spawn_posix.Popen(process_obj)
        if _unusable is None:
            try:
                return popen_forkserver.Popen(process_obj)
            except (OSError, EOFError) as exc:  # the fork server failed to start, or died
                _spawn_instead(f"the fork server failed ({exc.__class__.__name__}: {exc})")
        return popen_spawn_posix.Popen(process_obj)

    def run(self) -> None:
        """In the new process, before its target: the starting thread's environment, CPUs and policy. Only what
        differs is changed: emptying the C environment first leaves setproctitle (vLLM's process titles, as ``ps``
        shows them) unable to find the memory it writes to."""
        for gone in os.environ.keys() - self._environ.keys():
            del os.environ[gone]
        os.environ.update({k: v for k, v in self._environ.items() if os.environ.get(k) != v})
        os.sched_setaffinity(0, self._affinity)
        try:
            policy, priority = self._policy
            os.sched_setscheduler(0, policy, os.sched_param(priority))
        except OSError:  # back from SCHED_IDLE needs a privilege: the engine starts lowered, as the fork server
            pass
        super().run()


class EngineContext(mp_context.ForkServerContext):
    """vLLM's engine-core processes as :class:`EngineProcess` (vLLM asks its context for ``Process`` and
    ``Queue``)."""

    Process = EngineProcess


def context() -> multiprocessing.context.BaseContext | None:
    """The context engine-core processes start from: the fork server's, started here (preloading in the
    background) with this process's environment the first time; None where it cannot be used (the caller
    keeps vLLM's own)."""
    global _server_environ
    if _unusable is not None:
        return None
    ctx = EngineContext()
    if _server_environ is None:
        from multiprocessing import forkserver

        ctx.set_forkserver_preload(PRELOAD)
        _server_environ = dict(os.environ)
        try:
            forkserver.ensure_running()
        except OSError as exc:
            _spawn_instead(f"the fork server failed to start ({exc})")
            return None
    return ctx
