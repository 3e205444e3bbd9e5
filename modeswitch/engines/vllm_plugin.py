"""What the vLLM engines ModeSwitch starts load in each of their processes: a vLLM ``general_plugins`` entry
point (declared in pyproject.toml), which vLLM loads in its engine-core and worker processes before they set up
torch.distributed.

It binds an engine's worker to the CPUs ModeSwitch chose for that engine (``CPUS_KEY`` in the engine's
``additional_config``). vLLM binds a CPU worker's threads to the CPUs its ``VLLM_CPU_OMP_THREADS_BIND`` names,
read in the engine-core process when it starts its workers; the variable is process-wide, and engines start
together from one process, so each engine's choice travels in its own config instead. A worker re-pinned from
outside after it started does not stay put: its OpenMP runtime binds its main thread to its places again.

It also gives all of a process's gloo groups one gloo device. vLLM's CPU worker sets up 13 torch.distributed gloo
groups even for a single process, and torch gives each group a TCP device of its own, whose event-loop thread
(``gloo_tcp_loop``) wakes every 10 ms: 1.6 % of a core per idle engine, all the CPU an idle resident mode
costs, and 6-7 % for the four engines of the 8 modes. Gloo keeps its connections per group (context), not per
device, so one device serves every group, with one loop thread. torch's ``new_group`` ignores gloo options, so
the only place to pass the device is the ``ProcessGroupGloo`` that ``torch.distributed`` constructs.

Only in engines ModeSwitch starts (``VllmBackend`` sets ``ENV`` unless it is set: ``0`` keeps torch's device per
group): vLLM's own server, started from the same environment for the comparisons, stays as shipped.
"""

from __future__ import annotations

import os

#: Set to "1" in the environment of the engines that share one gloo device.
ENV = "MODESWITCH_ONE_GLOO_DEVICE"
#: the key of ``additional_config`` that names the CPUs an engine's worker computes on ("0,1": vLLM's list form)
CPUS_KEY = "modeswitch_cpus"
#: the pid of the ModeSwitch server whose engines these processes are (``VllmBackend`` sets it)
SERVER_ENV = "MODESWITCH_SERVER_PID"
#: how often an engine process checks that its parent is still there
PARENT_POLL_S = 1.0


def register() -> None:
    """The entry point vLLM calls, possibly more than once a process."""
    if os.environ.get(ENV) == "1":
        share_gloo_device()
    bind_engine_cpus()
    leave_with_parent()


def leave_with_parent() -> None:
    """In an engine process of a ModeSwitch server (not the server itself): exit once its parent is gone. An
    engine-core process whose server was killed (SIGKILL: nothing stops its engines) would otherwise keep its
    memory and CPUs for good, and a worker whose engine core died likewise. A thread polls the parent pid: the
    kernel's parent-death signal would fire when the *thread* that started the engine ends, and a staged start
    starts engines from threads that end. Idempotent."""
    import threading

    server = os.environ.get(SERVER_ENV)
    if not server or str(os.getpid()) == server or any(t.name == "modeswitch-parent-watch"
                                                       for t in threading.enumerate()):
        return
    parent = os.getppid()

    def watch() -> None:
        import time

        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # no clean-up to wait for: what it held goes with the process

    threading.Thread(target=watch, name="modeswitch-parent-watch", daemon=True).start()


def cpus_config(cpus: list[int]) -> dict[str, str]:
    """The ``additional_config`` that binds an engine's worker to ``cpus``."""
    return {CPUS_KEY: ",".join(map(str, cpus))}


def _named_cpus(additional_config: dict | None) -> list[int]:
    listed = (additional_config or {}).get(CPUS_KEY, "")
    return [int(c) for c in listed.split(",") if c]


def engine_cpus(engine_args: dict) -> list[int]:
    """The CPUs ``engine_args`` bind the engine's worker to (empty: vLLM's own binding)."""
    return _named_cpus(engine_args.get("additional_config"))


def bind_engine_cpus() -> None:
    """Have vLLM's CPU process manager bind the worker to the CPUs the engine's config names, where it names
    them (engines ModeSwitch starts); otherwise it binds as configured. Idempotent."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    init = OMPProcessManager.__init__
    if getattr(init, "binds_engine_cpus", False):
        return

    def __init__(self, config) -> None:
        init(self, config)
        cpus = _named_cpus(getattr(config, "additional_config", None))
        if cpus and getattr(self, "cpu_lists", None) is not None:
            self.skip_setup, self.auto_setup = False, False
            self.cpu_lists = [cpus] * len(self.cpu_lists or [0])

    __init__.binds_engine_cpus = True
    OMPProcessManager.__init__ = __init__


def share_gloo_device() -> None:
    """Make every gloo group ``torch.distributed`` creates from now on in this process use the same device(s):
    the ones torch would create for a group (the default device, or one per interface in GLOO_SOCKET_IFNAME,
    lazy or not as TORCH_GLOO_LAZY_INIT says), created once. Idempotent."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
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

    c10d.ProcessGroupGloo = OneDeviceGloo
