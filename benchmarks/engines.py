"""The modes benchmark on both engines, one after the other in one run, and a side-by-side table.

Runs ``benchmarks/modes.py`` with ``--backend transformers`` and then ``--backend vllm`` (same prompts, same
flags), then writes ``engines_<model>.{json,md}``: per mode TTFT, decode tokens/s and concurrent
throughput on each engine with the vLLM/transformers ratio, and vLLM's start time and resident memory per
engine.

    python benchmarks/engines.py                      # demo model, CPU
    python benchmarks/engines.py --repeats 1 -- --max-model-len 2048
    python benchmarks/engines.py --rerun vllm -- --max-model-len 2048   # keep today's transformers results

The two modes runs stay beside it as ``modes_<model>_engine-<engine>.{json,md}``; a run that is not rerun is
read from there and must be from the same UTC day.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
from modeswitch.bench.report import save_results  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    server_extra = argv[split + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--rerun", default="transformers,vllm",
                   help="engines to measure; the others' results of today are read from disk")
    args, modes_flags = p.parse_known_args(argv[:split])  # the rest goes to benchmarks/modes.py
    model, rerun = args.model, args.rerun.split(",")
    own = ["--model", model, *modes_flags]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    results = {}
    for engine in ("transformers", "vllm"):
        tag = f"engine-{engine}"
        if engine in rerun:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "modes.py"), *own, "--tag", tag,
                            "--no-perplexity", "--no-decision-loop", "--", "--backend", engine, *server_extra],
                           check=True)
        results[engine] = json.loads((OUT / f"modes_{Path(model).name}_{tag}.json").read_text())
        if not results[engine]["date"].startswith(stamp):
            raise SystemExit(f"the {engine} results on disk are from {results[engine]['date'][:10]}, not today: "
                             f"rerun it (--rerun {engine})")
    hf = {r["mode"]: r for r in results["transformers"]["modes"]}
    vl = {r["mode"]: r for r in results["vllm"]["modes"]}
    rows = []
    for mode in hf:
        if mode not in vl:
            continue
        a, b = hf[mode], vl[mode]
        conc = next(k for k in a if k.startswith("concurrent") and k.endswith("_tok_s"))
        rows.append({"mode": mode, "ttft_ms": (a["ttft_ms"], b["ttft_ms"]),
                     "decode_tok_s": (a["decode_tok_s"], b["decode_tok_s"]),
                     "concurrent_tok_s": (a[conc], b[conc]),
                     "agreement_with_fp16": (a.get("agreement_with_fp16"), b.get("agreement_with_fp16"))})
    lines = [f"# transformers vs vLLM engine: {model} ({stamp})", "",
             f"Server start: transformers {results['transformers']['server_start_s']:.1f} s, "
             f"vLLM {results['vllm']['server_start_s']:.1f} s (every mode, warm-up included).", "",
             "| mode | TTFT ms (tf / vLLM) | decode tok/s (tf / vLLM, ratio) | tok/s concurrent (tf / vLLM, ratio) |",
             "|---|---|---|---|"]
    for r in rows:
        (t1, t2), (d1, d2), (c1, c2) = r["ttft_ms"], r["decode_tok_s"], r["concurrent_tok_s"]
        lines.append(f"| {r['mode']} | {t1:.0f} / {t2:.0f} | {d1:.1f} / {d2:.1f} ({d2 / d1:.2f}x) | "
                     f"{c1:.1f} / {c2:.1f} ({c2 / c1:.2f}x) |")
    lines += ["", "vLLM engines (modes, start time, resident memory of the engine-core process):", "",
              "| engine | modes | start s | RSS MiB |", "|---|---|---|---|"]
    for key, e in (results["vllm"].get("engines") or {}).items():
        lines.append(f"| {key} | {', '.join(e['modes'])} | {e['startup_s']} | {e['rss_bytes'] / 2**20:.0f} |")
    md = "\n".join(lines) + "\n"
    save_results(OUT, f"engines_{Path(model).name}", "", {"rows": rows, "runs": results}, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
