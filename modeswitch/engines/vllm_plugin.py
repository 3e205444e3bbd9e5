"""What the vLLM engines ModeSwitch starts load in each of their processes: a vLLM ``general_plugins`` entry
point (declared in pyproject.toml), which vLLM loads in its engine-core and worker processes before they set up
torch.distributed.

It gives all of a process's gloo groups one gloo device. vLLM's CPU worker sets up 13 torch.distributed gloo
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


def register() -> None:
    """The entry point vLLM calls, possibly more than once a process."""
    if os.environ.get(ENV) == "1":
        share_gloo_device()


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
