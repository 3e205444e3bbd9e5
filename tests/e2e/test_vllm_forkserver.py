"""The engine-core processes of ModeSwitch's vLLM engines are forked from a fork server that preloaded vLLM
(modeswitch.engines.vllm.forkserver), with the environment the server has when it starts them; vLLM's own server
from the same environment still spawns them; engine processes leave when the server dies.

Real processes throughout: a script plays the server (``SERVER_ENV`` names its own pid, the plugin registered as vLLM
registers it, vLLM's CPU platform configured by a real engine config) and starts processes from the context vLLM's
engine-core process manager asks for, as vLLM does. What each started process reports is read before anything
imports vLLM in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from modeswitch.engines.vllm.plugin import SERVER_ENV

#: the "server": configures an engine as vLLM's LLMEngine does (plugins, then the CPU platform's config), then
#: starts a process from vLLM's engine-core context, changes its environment as argv[2] says, starts another,
#: and reports each; it then waits to be killed (or for a process of its to end, which it reports)
SERVER = """
import json, os, sys
from multiprocessing.connection import wait
if sys.argv[1] == "modeswitch":
    os.environ["MODESWITCH_SERVER_PID"] = str(os.getpid())
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine import utils
from modeswitch.weights.presets import prepare_demo_checkpoint
EngineArgs(model=str(prepare_demo_checkpoint()), max_model_len=512, kv_cache_memory_bytes=2**26).create_engine_config()
PROBE = '''
import json, os, sys, threading, multiprocessing
preloaded = "vllm.v1.engine.core" in sys.modules
from vllm.plugins import load_general_plugins
load_general_plugins()  # as vLLM's engine core does
from vllm.utils.system_utils import set_process_title
set_process_title("EngineCore")  # as vLLM's engine core names itself
report = dict(title=open("/proc/self/cmdline").read().split(chr(0))[0], pid=os.getpid(), ppid=os.getppid(), preloaded=preloaded, late=os.environ.get("LATE"),
              starter=multiprocessing.parent_process().pid, threads=[t.name for t in threading.enumerate()])
print("PROBE " + json.dumps(report), flush=True)
threading.Event().wait()
'''
ctx = utils.get_mp_context()
os.environ["LATE"] = "set after the fork server started"
procs = [ctx.Process(target=exec, args=(PROBE, {}), daemon=True)]
procs[0].start()
if sys.argv[2] == "omp":  # read when torch loads: the fork server's copy is stale
    os.environ["OMP_NUM_THREADS"] = "1"
    procs.append(ctx.Process(target=exec, args=(PROBE, {}), daemon=True))
    procs[1].start()
print("SERVER " + json.dumps(dict(pid=os.getpid(), method=ctx.get_start_method())), flush=True)
wait([p.sentinel for p in procs], timeout=600)
print("ENDED " + json.dumps([p.exitcode for p in procs]), flush=True)
"""


def serve(kind: str, then: str = "") -> tuple[subprocess.Popen, dict, list[dict], str]:
    """Start the server script; return it, its report, its processes' reports, and its log lines."""
    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    server = subprocess.Popen([sys.executable, "-c", SERVER, kind, then or "-"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wanted, reports, lines = 2 if then else 1, [], []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("PROBE "):
            reports.append(json.loads(line[6:]))
        if line.startswith("SERVER "):
            me = json.loads(line[7:])
        if len(reports) == wanted and any(line.startswith("SERVER ") for line in lines):
            return server, me, reports, "".join(lines)
    server.kill()
    raise AssertionError("".join(lines)[-3000:])


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            return True
        time.sleep(0.05)
    return False


def test_an_engine_process_is_forked_preloaded_with_the_servers_environment_and_leaves_with_the_server():
    """Forked by the fork server (its parent), vLLM imported before its code ran, the variable the server set after
    the fork server started seen, named as vLLM names it (``ps``), the plugin's parent watch running in it (threads do not survive a fork); a
    variable read at import changed since then: that process is spawned, with one line saying why. SIGKILL to the
    server: both processes are gone within a second (the fork server, once they are, a few seconds later: it ends
its interpreter with torch and vLLM loaded)."""
    server, me, (forked, spawned), log = serve("modeswitch", "omp")
    try:
        assert me["method"] == "forkserver"
        fork_server = forked["ppid"]
        assert fork_server != me["pid"] and psutil.Process(fork_server).ppid() == me["pid"]
        assert forked["starter"] == me["pid"] and forked["preloaded"]
        assert forked["late"] == "set after the fork server started"
        assert "modeswitch-parent-watch" in forked["threads"]
        assert forked["title"] == "VLLM::EngineCore"
        assert spawned["ppid"] == me["pid"] and not spawned["preloaded"]
        assert log.count("spawned, not forked") == 1 and "(OMP_NUM_THREADS)" in log
    finally:
        server.kill()
        server.wait()
    assert gone_within([forked["pid"], spawned["pid"]], 1.0)
    assert gone_within([fork_server], 10.0)


def test_vllms_own_server_from_the_same_environment_still_spawns_its_engine_processes():
    server, me, (report,), _ = serve("vllm")
    try:
        assert me["method"] == "spawn"
        assert report["ppid"] == me["pid"] and not report["preloaded"]
        assert "modeswitch-parent-watch" not in report["threads"]
    finally:
        server.kill()
        server.wait()
        if psutil.pid_exists(report["pid"]):  # nothing makes vLLM's own processes leave with their server
            psutil.Process(report["pid"]).kill()
