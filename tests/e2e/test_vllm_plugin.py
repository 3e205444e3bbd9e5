"""The plugin ModeSwitch's vLLM engines load (modeswitch.engines.vllm.plugin): every gloo group in a process
on one gloo device, so an idle engine runs one gloo event-loop thread instead of 13 (real torch.distributed
groups in real processes, set up as vLLM's CPU worker sets them up: a default group and 12 more); an engine's
worker in its engine-core process (a real vLLM engine config); nothing at all in a process that is not
ModeSwitch's (vLLM's own plugin loader, as vLLM's own server runs it); an untested vLLM refused in one line.

The processes here are ModeSwitch engine processes as the server starts them: ``SERVER_ENV`` names a server (this
test's process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from modeswitch.engines.vllm import compat
from modeswitch.engines.vllm.int8_fbgemm import onednn_lacks_int8_kernel
from modeswitch.engines.vllm.plugin import ENV, SERVER_ENV

#: the environment of a ModeSwitch engine process
ENGINE_ENV = {**os.environ, SERVER_ENV: str(os.getpid())}

GROUPS = 12
RANK = """
import os, sys
import torch, torch.distributed as dist
from modeswitch.engines.vllm.plugin import register
register()
rank, world, port, groups = (int(a) for a in sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
total = 0.0
for group in [dist.new_group(list(range(world))) for _ in range(groups)]:
    t = torch.full((3,), rank + 1.0)
    dist.all_reduce(t, group=group)
    total += t.sum().item()
loops = [os.path.join("/proc/self/task", tid, "comm") for tid in os.listdir("/proc/self/task")]
print(total, sum(open(comm).read().strip() == "gloo_tcp_loop" for comm in loops))
dist.destroy_process_group()
"""


def run_ranks(world: int, shared: bool) -> list[tuple[float, int]]:
    """Each rank's (sum of its all-reduces over the extra groups, gloo loop threads it runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in ENGINE_ENV.items() if k != ENV} | ({ENV: "1"} if shared else {})
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(world), str(port), str(GROUPS)],
                              env=env, stdout=subprocess.PIPE, text=True) for rank in range(world)]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * world
    return [(float(total), int(loops)) for total, loops in (out.split() for out in outs)]


def test_groups_across_two_processes_share_one_device_and_still_reduce_right():
    expected = GROUPS * 3 * (1 + 2)  # every element of every group's all-reduce: rank 0's 1 + rank 1's 2
    assert run_ranks(world=2, shared=True) == [(expected, 1), (expected, 1)]


def test_without_the_variable_the_plugin_leaves_torch_as_shipped():
    """vLLM's own server in the comparisons loads the plugin from the same environment: one device per group."""
    assert run_ranks(world=1, shared=False) == [(GROUPS * 3, GROUPS + 1)]


CONFIG = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from modeswitch.engines.vllm.plugin import engine_config, register
from modeswitch.weights.presets import prepare_demo_checkpoint
register()
register()  # vLLM may call it more than once a process
def backend(additional):
    args = EngineArgs(model=str(prepare_demo_checkpoint()), max_model_len=512, kv_cache_memory_bytes=2**26,
                      additional_config=additional)
    return args.create_engine_config().parallel_config.distributed_executor_backend
print(json.dumps([backend(engine_config([int(sys.argv[1])])), backend({})]))
"""


def test_an_engine_modeswitch_starts_keeps_its_worker_in_its_engine_process():
    """vLLM's CPU platform turns a single worker into a worker process; an engine whose config asks for one
    process keeps vLLM's single-process executor, and one that does not (vLLM's own server) is left as shipped."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    out = subprocess.run([sys.executable, "-c", CONFIG, str(cpu)], capture_output=True, text=True, timeout=300,
                         env={**ENGINE_ENV, "VLLM_TARGET_DEVICE": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["uni", "mp"]


LOADER = """
import json, os, sys
if sys.argv[1:] == ["server"]:
    os.environ["MODESWITCH_SERVER_PID"] = str(os.getpid())
from vllm.plugins import load_general_plugins
from modeswitch.engines.vllm import compat
load_general_plugins()  # what every vLLM process does, vLLM's own server included
print(json.dumps(sorted(compat._replaced)))
"""


def test_vllms_own_processes_run_unpatched_and_modeswitchs_are_patched():
    """vLLM's plugin loader finds ModeSwitch's entry point in every process of the environment: in one that is not
    a ModeSwitch server or engine (vLLM's own server, started from the same environment) it replaces nothing; in
    an engine process it replaces every target but the gloo group (only with ``ENV``=1), the context engine
    processes start from, which only the server replaces, and, where oneDNN has an int8 kernel for the CPU
    (AVX-512, VNNI), the W8A8 linears' weights, which stay vLLM's."""

    def replaced(env, *argv):
        out = subprocess.run([sys.executable, "-c", LOADER, *argv], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    functions = {t.where for t in compat.TARGETS.values() if t.params is not None}  # gloo's group is a class
    context = compat.TARGETS["engine_mp_context"].where
    fbgemm = set() if onednn_lacks_int8_kernel() else {compat.TARGETS["cpu_int8_onednn_weights"].where}
    assert replaced({k: v for k, v in os.environ.items() if k not in (SERVER_ENV, ENV)}) == []
    assert replaced({k: v for k, v in ENGINE_ENV.items() if k != ENV}) == sorted(functions - {context} - fbgemm)
    assert context in replaced({k: v for k, v in os.environ.items() if k not in (SERVER_ENV, ENV)}, "server")


REFUSED = """
from modeswitch.engines.vllm import compat, plugin
compat.installed_vllm = lambda: "0.35.0"
plugin.register()
"""


def test_an_engine_process_refuses_an_untested_vllm_in_one_line():
    out = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True, timeout=300, env=ENGINE_ENV)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("modeswitch: vLLM 0.35.0 is untested") and ">=0.32.0,<0.33" in last
