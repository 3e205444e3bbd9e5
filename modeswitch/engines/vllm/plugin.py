"""What the vLLM engines ModeSwitch starts load in each of their processes: a vLLM ``general_plugins`` entry
point (declared in pyproject.toml), which vLLM loads in its engine-core and worker processes before they set up
torch.distributed.

It runs an engine's worker inside the engine-core process, bound to the CPUs ModeSwitch chose for that engine
(``ONE_PROCESS_KEY`` and ``CPUS_KEY`` in the engine's ``additional_config``). vLLM's CPU platform always runs
a worker process beside the engine core (its "mp" executor, so that OpenMP can be set up from the environment
before the worker imports torch); that second process holds another copy of vLLM, torch and their Python heap
per engine, a large share of what a small model's engines hold, and every step crosses between the two. One
process per engine ("uni", vLLM's executor for a single GPU), with the computing thread bound and torch's thread
count set from the engine's CPUs, holds that memory once and serves faster.

It also gives all of a process's gloo groups one gloo device. vLLM's CPU worker sets up 13 torch.distributed gloo
groups even for a single process, and torch gives each group a TCP device of its own, whose event-loop thread
(``gloo_tcp_loop``) wakes every 10 ms: those threads' polling is all the CPU an idle engine costs. Gloo keeps
its connections per group (context), not per device, so one device serves every group, with one loop thread.
torch's ``new_group`` ignores gloo options, so the only place to pass the device is the ``ProcessGroupGloo`` that
``torch.distributed`` constructs.

Only in engines ModeSwitch starts (``backends.vllm.start`` sets ``ENV`` unless it is set: ``0`` keeps torch's device per
group).

And it loads :mod:`.drafting` (n-gram drafting bounded per request) into every engine, keeps a float32 engine's
W8A8 int8 linears off an AMX kernel that takes only 16-bit activations, puts them on FBGEMM where oneDNN has no
int8 kernel for the CPU (:mod:`.int8_fbgemm`); in the server, it has vLLM start
engine-core processes from a fork server that imported vLLM once (:mod:`.forkserver`).

The entry point loads into every vLLM process of the environment, so it does nothing at all in a process that is
neither a ModeSwitch server nor one of its engines (``SERVER_ENV`` unset): vLLM's own server, started from the same
environment for the comparisons, runs as shipped; with ``FBGEMM_ENV=1`` it gets the FBGEMM int8 linears alone
(what ModeSwitch's int8 engines compute with, for a like-with-like peer on a CPU where they use it). Every symbol it
replaces is read and replaced through :mod:`.compat`, which it asks first whether the installed vLLM is one they
were checked on.
"""

from __future__ import annotations

import functools
import os

from . import compat, drafting, forkserver, int8_fbgemm

#: Set to "1" in the environment of the engines that share one gloo device.
ENV = "MODESWITCH_ONE_GLOO_DEVICE"
#: the key of ``additional_config`` that names the CPUs an engine's worker computes on ("0,1": vLLM's list form)
CPUS_KEY = "modeswitch_cpus"
#: the key of ``additional_config`` that keeps an engine's worker in its engine-core process
ONE_PROCESS_KEY = "modeswitch_one_process"
#: the pid of the ModeSwitch server whose engines these processes are (``backends.vllm.start`` sets it)
SERVER_ENV = "MODESWITCH_SERVER_PID"
#: set to "1" for vLLM's own server (not ModeSwitch's) to put its W8A8 int8 linears on FBGEMM as ModeSwitch's engines
#: do where oneDNN lacks an int8 kernel (``int8_fbgemm``), and nothing else of this plugin
FBGEMM_ENV = "MODESWITCH_VLLM_FBGEMM_INT8"
#: how often an engine process checks that its parent is still there
PARENT_POLL_S = 1.0


def register() -> None:
    """The entry point vLLM calls, possibly more than once a process. Nothing in a process that is not a
    ModeSwitch server or engine. Elsewhere an untested vLLM, or a target that changed, ends the process with one
    line: vLLM logs an exception from a plugin and goes on, which would leave an engine running unpatched (plain
    modes drafting unbounded, workers on the wrong CPUs)."""
    if not modeswitch_process():
        if os.environ.get(FBGEMM_ENV) == "1":
            _require_compatible()
            int8_fbgemm.use_fbgemm_for_int8()
        return
    _require_compatible()
    if os.environ.get(ENV) == "1":
        share_gloo_device()
    keep_worker_in_engine_process()
    bind_worker_threads()
    drafting.draft_per_request(_one_process)
    if in_engine_process():
        drafting.fix_cpu_expand()
        drafting.fix_empty_drafts()
        keep_int8_off_amx_in_float32()
        int8_fbgemm.use_fbgemm_for_int8()
    else:
        fork_engine_processes()
    leave_with_parent()
    from ... import logs
    from ...device import keep_heap_trimmed

    logs.quiet_libraries()
    if in_engine_process():
        keep_heap_trimmed()  # what loading the weights and compiling the graphs freed goes back to the system


def keep_int8_off_amx_in_float32() -> None:
    """vLLM sends a W8A8 int8 linear to sgl-kernel's AMX matmul wherever the CPU has AMX, whatever the model's dtype,
    and that matmul takes bf16 or fp16 activations only: an int8 engine computing in float32 (``--dtype float32``)
    dies at its first step ("int8_scaled_mm_with_quant: expect A to be bfloat16 or half"). In float32 such a layer
    goes to oneDNN's int8 matmul, as on a CPU without AMX. The model's dtype is torch's default dtype while vLLM
    processes the loaded weights, which is when it asks. Idempotent."""
    import torch

    check = compat.original("cpu_sgl_check")
    if getattr(check, "float32_to_onednn", False):
        return

    def check_cpu_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:
        if dtype == torch.int8 and torch.get_default_dtype() not in (torch.bfloat16, torch.float16):
            return False
        return check(n, k, dtype)

    check_cpu_sgl_kernel.float32_to_onednn = True  # type: ignore[attr-defined]
    compat.replace("cpu_sgl_check", check_cpu_sgl_kernel)


def modeswitch_process() -> bool:
    """A ModeSwitch server, or a process of one of its vLLM engines (they inherit ``SERVER_ENV``)."""
    return bool(os.environ.get(SERVER_ENV))


@functools.cache
def _require_compatible() -> None:
    try:
        compat.require()
    except compat.VllmIncompatible as exc:
        raise SystemExit(f"modeswitch: {exc}") from None


def in_engine_process() -> bool:
    """An engine's process of a ModeSwitch server, not the server itself (which loads the plugin too)."""
    server = os.environ.get(SERVER_ENV)
    return bool(server) and str(os.getpid()) != server


def leave_with_parent() -> None:
    """In an engine process of a ModeSwitch server (not the server itself): exit once the process that started it
    is gone. An engine-core process whose server was killed (SIGKILL: nothing stops its engines) would otherwise
    keep its memory and CPUs for good, and a worker whose engine core died likewise. A thread waits on
    ``multiprocessing``'s parent sentinel (a pipe the starting process holds, closed by the kernel when it dies):
    the OS parent of an engine forked by :mod:`.forkserver` is the fork server, which lives as long as any engine
    does, and the kernel's parent-death signal would fire when the *thread* that started the engine ends, and a
    staged start starts engines from threads that end. A process not started by ``multiprocessing`` (vLLM runs
    some of its checks in a subprocess) polls its parent pid instead. Idempotent."""
    import multiprocessing
    import threading

    if not in_engine_process() or any(t.name == "modeswitch-parent-watch" for t in threading.enumerate()):
        return
    starter, parent = multiprocessing.parent_process(), os.getppid()

    def watch() -> None:
        import time
        from multiprocessing.connection import wait

        if starter is not None:
            wait([starter.sentinel])
        else:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
        os._exit(1)  # no clean-up to wait for: what it held goes with the process

    threading.Thread(target=watch, name="modeswitch-parent-watch", daemon=True).start()


def fork_engine_processes() -> None:
    """In the server: vLLM's engine-core processes forked from a fork server that preloaded vLLM
    (:mod:`.forkserver`), where vLLM's CPU platform would spawn each one; vLLM's own context elsewhere, and where
    the fork server cannot be used. Idempotent."""
    get = compat.original("engine_mp_context")
    if getattr(get, "forks_engines", False):
        return

    def get_mp_context():
        from vllm.platforms import current_platform

        return (current_platform.is_cpu() and forkserver.context()) or get()

    get_mp_context.forks_engines = True
    compat.replace("engine_mp_context", get_mp_context)


def engine_config(cpus: list[int]) -> dict[str, str]:
    """The ``additional_config`` of an engine ModeSwitch starts: its worker in its engine-core process, computing
    on ``cpus`` (empty: as torch sets itself up)."""
    return {ONE_PROCESS_KEY: "1", CPUS_KEY: ",".join(map(str, cpus))}


def _named_cpus(additional_config: dict | None) -> list[int]:
    listed = (additional_config or {}).get(CPUS_KEY, "")
    return [int(c) for c in listed.split(",") if c]


def engine_cpus(engine_args: dict) -> list[int]:
    """The CPUs ``engine_args`` bind the engine's worker to (empty: vLLM's own binding)."""
    return _named_cpus(engine_args.get("additional_config"))


def _one_process(vllm_config) -> bool:
    return (getattr(vllm_config, "additional_config", None) or {}).get(ONE_PROCESS_KEY) == "1"


def keep_worker_in_engine_process() -> None:
    """Undo the CPU platform's switch from the single-process executor to worker processes, for engines whose
    config asks for one process (vLLM's own server is left as shipped). Idempotent."""
    check = compat.original("cpu_platform_config")
    if getattr(check, "keeps_one_process", False):
        return
    original = check.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        parallel = vllm_config.parallel_config
        if _one_process(vllm_config) and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"

    check_and_update_config.keeps_one_process = True
    compat.replace("cpu_platform_config", classmethod(check_and_update_config))


def bind_worker_threads() -> None:
    """Where a CPU worker runs in its engine-core process: bind the thread that runs it (the engine core's main
    thread; OpenMP's threads inherit it) to the engine's CPUs and use one torch thread per CPU, as vLLM's worker
    processes are set up from the environment. Before vLLM's worker setup, which then forbids
    ``torch.set_num_threads``. Idempotent."""
    init = compat.original("cpu_worker_init")
    if getattr(init, "binds_threads", False):
        return

    def init_device(self) -> None:
        cpus = _named_cpus(getattr(self.vllm_config, "additional_config", None))
        if _one_process(self.vllm_config) and cpus:
            import torch

            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(len(cpus))
        init(self)

    init_device.binds_threads = True
    compat.replace("cpu_worker_init", init_device)


def share_gloo_device() -> None:
    """Make every gloo group ``torch.distributed`` creates from now on in this process use the same device(s):
    the ones torch would create for a group (the default device, or one per interface in GLOO_SOCKET_IFNAME,
    lazy or not as TORCH_GLOO_LAZY_INIT says), created once. Idempotent."""
    base = compat.original("gloo_group")
    if getattr(base, "shares_devices", False):
        return
    devices: list = []

    class OneDeviceGloo(base):
        """torch's gloo group, on the process's shared devices; its options otherwise as torch sets them."""

        shares_devices = True

        def __init__(self, store, rank, size, timeout=None):
            if not devices:
                interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
                devices.extend([base.create_device(interface=i) for i in interfaces]
                               or [base.create_default_device()])
            options = base._Options()
            options._devices = devices
            options._threads = 2 * len(devices)
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    compat.replace("gloo_group", OneDeviceGloo)
