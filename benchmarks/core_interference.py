"""How much a busy core slows another on this machine: what the cost model's lanes assume away.

ModeSwitch puts its engines on cores of their own and predicts each engine's steps from what that engine measured,
counting only the engines that share its cores. That holds where cores are independent. On a VM whose vCPUs are
hyperthreads of one physical core (or share a power budget), a step on one core is slower while the other computes,
and an engine started on an idle core slows the busy one. This measures it: one thread pinned to the first CPU runs
a fixed kernel for a few seconds, alone and then beside a process pinned to each other CPU that spins (a pure Python
loop: no memory traffic) or runs the same kernel; for two kernels, a 512x512 fp32 matmul (compute-bound, as a
prompt's prefill) and a 4096x4096 fp32 matrix-vector product (64 MiB read a step: memory-bound, as a decode step).
Prints the rate beside each neighbour over the rate alone, and writes JSON.

    .venv/bin/python benchmarks/core_interference.py [--seconds 3] [--tag T]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.device import machine  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

#: kernel -> the shapes multiplied
KERNELS = {"matmul 512x512": ((512, 512), (512, 512)), "matvec 4096x4096": ((4096, 4096), (4096,))}
#: what runs on the other CPUs: a spin, or the kernel measured
NEIGHBOURS = ("spin", "same kernel")


def kernel(name: str):
    """The operation timed: one product of ``name``'s shapes, on one thread."""
    import torch

    torch.set_num_threads(1)
    a, b = (torch.randn(*shape) for shape in KERNELS[name])
    return lambda: a @ b


def rate(op, seconds: float) -> float:
    """Operations a second over ``seconds``."""
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        op()
        n += 1
    return n / (time.perf_counter() - start)


def neighbour(cpu: int, what: str) -> subprocess.Popen:
    """This script on ``cpu`` running ``what`` (a kernel's name, or ``spin``) until killed."""
    return subprocess.Popen([sys.executable, __file__, "--run", what, "--cpu", str(cpu)])


def run_forever(what: str, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    if what == "spin":
        while True:
            pass
    op = kernel(what)
    while True:
        op()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0, help="timed per measurement")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--run", help=argparse.SUPPRESS)  # a neighbour: this kernel (or spin), forever
    ap.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_forever(args.run, args.cpu)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("one CPU: nothing beside it to measure")
        return 0
    os.sched_setaffinity(0, {cpus[0]})
    rows = []
    for name in KERNELS:
        timed = kernel(name)
        alone = rate(timed, args.seconds)
        row = {"kernel": name, "alone_per_s": round(alone, 1)}
        for beside in NEIGHBOURS:
            others = [neighbour(cpu, "spin" if beside == "spin" else name) for cpu in cpus[1:]]
            try:
                time.sleep(2)  # started and running
                row[f"beside {beside}"] = round(rate(timed, args.seconds) / alone, 3)
            finally:
                for p in others:
                    p.kill()
                    p.wait()
        rows.append(row)
    lines = [f"# A busy core's effect on another ({processor()})", "",
             f"One thread on CPU {cpus[0]}; beside it, one process on each of CPUs {cpus[1:]}. Rate over the rate alone.",
             "", "| kernel | alone (per s) | " + " | ".join(f"beside {n}" for n in NEIGHBOURS) + " |",
             "|---|---|" + "---|" * len(NEIGHBOURS)]
    lines += [f"| {r['kernel']} | {r['alone_per_s']} | " + " | ".join(f"{r[f'beside {n}']:.2f}x" for n in NEIGHBOURS)
              + " |" for r in rows]
    text = "\n".join(lines)
    print(text)
    save_results(args.out, "core_interference", args.tag, {"cpu_flags": machine(), "cpus": cpus, "rows": rows},
                 text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
