"""A newcomer's first answer: ``make serve`` on a fresh clone, timed from the command to the first completion.

Clones this repository's HEAD into a temporary directory and runs ``make serve`` there with an empty model cache
(``MODESWITCH_CACHE``: the demo's converted checkpoints, vLLM's and Inductor's compile caches, the engine start
history), so setup installs a new virtual environment, converts the demo model and builds what the first modes
need. Records when the server first answers a completion, when every mode is up, and when no engine is left
starting or compiling behind (the mode cards all say ``decode: compiled``). pip's own download cache is left
as it is (a newcomer's machine may or may not have one: say which in the tag).

    .venv/bin/python benchmarks/first_answer.py [--tag warm-pip-cache] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.serving.launcher import ROOT, free_port  # noqa: E402


def first_completion(url: str) -> dict | None:
    try:
        resp = requests.post(url + "/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 8},
                             timeout=60)
    except requests.RequestException:
        return None
    return resp.json() if resp.status_code == 200 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default="")
    ap.add_argument("--limit-s", type=float, default=1800, help="give up after this long")
    ap.add_argument("--keep", default=None, help="clone into this directory and keep it (default: a temporary one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="modeswitch-fresh-"))
    clone, cache = work / "clone", work / "cache"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "TORCHINDUCTOR_", "VLLM_"))}
    env["MODESWITCH_CACHE"] = str(cache)
    log_file = work / "make-serve.log"
    began = time.time()
    proc = subprocess.Popen(["make", "serve", f"ARGS=--model demo --port {port}"], cwd=clone, env=env,
                            stdout=log_file.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    marks: dict[str, float] = {}
    try:
        while time.time() - began < args.limit_s and proc.poll() is None:
            elapsed = round(time.time() - began, 1)
            if "listening" not in marks:
                try:
                    if requests.get(url + "/health", timeout=2).status_code == 200:
                        marks["listening"] = elapsed
                except requests.RequestException:
                    pass
            if "listening" in marks and "first_answer" not in marks and first_completion(url):
                marks["first_answer"] = round(time.time() - began, 1)
                print(f"first answer {marks['first_answer']} s after make serve", flush=True)
            if "first_answer" in marks:
                info = requests.get(url + "/v1/modes", timeout=30).json()
                loading = [m["name"] for m in info["modes"] if m["status"] == "loading"]
                if not loading and "all_modes_up" not in marks:
                    marks["all_modes_up"] = elapsed
                    marks["modes_available"] = sum(m["status"] == "available" for m in info["modes"])
                    print(f"every mode up {elapsed} s after make serve", flush=True)
                if not loading and all(m.get("decode") != "eager" for m in info["modes"]
                                       if m["status"] == "available"):
                    marks["all_compiled"] = elapsed
                    print(f"every engine compiled {elapsed} s after make serve", flush=True)
                    break
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_file.read_text()
    summary = {"processor": processor(), **marks}
    lines = ["| step | seconds after `make serve` |", "|---|---|"]
    lines += [f"| {k.replace('_', ' ')} | {v} |" for k, v in marks.items() if k != "modes_available"]
    table = "\n".join(lines) + f"\n\nmodes available at the end: {marks.get('modes_available')}\n"
    print(table)
    if "first_answer" not in marks:
        print(text[-3000:])
    stem = save_results(args.out, "first_answer", args.tag, summary,
                        f"# First answer on a fresh clone ({processor()})\n\n{table}")
    print(f"wrote {stem}.json/.md")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if "first_answer" in marks else 1


if __name__ == "__main__":
    raise SystemExit(main())
