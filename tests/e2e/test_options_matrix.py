"""Every request option, pinned to every mode: honoured with its effect where the mode's ``/v1/modes`` card claims
it, refused with a 400 naming it where it does not. Both real servers of the suite (transformers and vLLM) are
asked; the claims print as the table in ``docs/options.md``, which this test keeps true.

The checks are short (a few tokens each) and sequential on an idle server, so a seeded repeat meets the same batch
conditions. Each looks for the option's own effect against the same mode without it. Regenerate the page's tables
with ``MODESWITCH_WRITE_MATRIX=1`` set when a mode's claims change.
"""

from __future__ import annotations

import os
import re
from typing import Callable

import pytest
import requests
from openai import BadRequestError, OpenAI

from modeswitch.sampling_params import OPTIONS
from modeswitch.serving.launcher import ROOT
from openai_checks import assert_most_likely

#: prompts whose greedy continuations on the demo are known: counting repeats " 1, 1, ..."; the pair repeats
#: " a b a b" on most modes (a presence or frequency penalty of 2 breaks it within 4 tokens; the GPTQ weights on
#: vLLM's AVX512 kernel answer in prose, which repeats a token within 16); the question ends after "No"
COUNTING, OPEN, REPEATING = "1, 1, 1, 1, 1,", "My favourite animal is", "a b a b a b a b"
SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
COMMA = 28  # the demo's "," token
#: fields the openai client sends in ``extra_body`` (vLLM's, not OpenAI's)
EXTRA_BODY = frozenset({"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                        "structured_outputs"})


class Pinned:
    """Requests pinned to one mode, each checked to be served by it; greedy unless a temperature is given."""

    def __init__(self, client: OpenAI, mode: str, honours: frozenset[str] = frozenset()) -> None:
        self.client, self.mode, self.honours = client, mode, honours
        self._greedy: dict[tuple[str, int], str] = {}

    def _split(self, options: dict) -> tuple[dict, dict]:
        options = {"temperature": 0.0, **options}
        extra = {k: options.pop(k) for k in EXTRA_BODY & options.keys()}
        return options, {"mode": self.mode, **extra}

    def complete(self, prompt: str, max_tokens: int = 3, **options):
        options, extra = self._split(options)
        raw = self.client.completions.with_raw_response.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                                               extra_body=extra, **options)
        assert raw.headers["X-ModeSwitch-Mode"] == self.mode
        return raw.parse()

    def chat(self, messages: list[dict], max_tokens: int, **options):
        options, extra = self._split(options)
        raw = self.client.chat.completions.with_raw_response.create(model="demo", messages=messages,
                                                                    max_tokens=max_tokens, extra_body=extra, **options)
        assert raw.headers["X-ModeSwitch-Mode"] == self.mode
        return raw.parse()

    def text(self, prompt: str, max_tokens: int = 3, **options) -> str:
        return self.complete(prompt, max_tokens, **options).choices[0].text

    def greedy(self, prompt: str, max_tokens: int = 3) -> str:
        """The mode's plain greedy text (asked once): what an option's effect is measured against."""
        if (prompt, max_tokens) not in self._greedy:
            self._greedy[prompt, max_tokens] = self.text(prompt, max_tokens)
        return self._greedy[prompt, max_tokens]


def _temperature(m: Pinned) -> None:
    assert m.complete(OPEN, temperature=1.0).usage.completion_tokens >= 1  # served; its effect: see _seed


def _seed(m: Pinned) -> None:
    first = m.text(OPEN, 6, temperature=1.0, seed=1)
    assert m.text(OPEN, 6, temperature=1.0, seed=1) == first
    assert any(m.text(OPEN, 6, temperature=1.0, seed=s) != first for s in (2, 3, 4))


def _restricts_to_the_likeliest(**option) -> Callable[[Pinned], None]:
    """top_k 1, a tiny top_p and min_p 1 leave only the likeliest token: every token of a hot sample is the likeliest
    by its own request's logits (its top logprobs), on a mode that returns them; else it is the greedy text. Another
    request's greedy text is the weaker check: two requests may round apart (vLLM's GPTQ kernel computes in bf16
    whatever the engine's dtype), and a near tie then parts them."""
    def check(m: Pinned) -> None:
        if "logprobs" not in m.honours:
            assert m.text(OPEN, temperature=2.0, **option) == m.greedy(OPEN)
            return
        lp = m.complete(OPEN, temperature=2.0, logprobs=3, **option).choices[0].logprobs
        assert lp.tokens
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert logprob == max(top.values()), (token, logprob, top)
    return check


def _breaks_repetition(**option) -> Callable[[Pinned], None]:
    def check(m: Pinned) -> None:
        assert m.text(REPEATING, 16, **option) != m.greedy(REPEATING, 16)
    return check


def _repetition_penalty(m: Pinned) -> None:
    assert not m.text(COUNTING, repetition_penalty=1.5).startswith(" 1")  # over the prompt's tokens too


def _logit_bias(m: Pinned) -> None:
    assert m.text(OPEN, 1, logit_bias={str(COMMA): 100}) == ","


def _stop_token_ids(m: Pinned) -> None:
    """The text ends before the first "," and without it (greedy counting writes one within 6 tokens on most modes;
    where a mode's greedy text has none, nothing stops it)."""
    plain = m.greedy(COUNTING, 6)
    out = m.complete(COUNTING, 6, stop_token_ids=[COMMA]).choices[0]
    assert (out.finish_reason, out.text) == (("stop", plain.split(",")[0]) if "," in plain else ("length", plain))


def _min_tokens(m: Pinned) -> None:
    out = m.complete(COUNTING, 5, stop_token_ids=[COMMA], min_tokens=5)  # "," may not end it before 5 tokens
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5


def _ignore_eos(m: Pinned) -> None:
    plain, longer = m.chat(SHORT_ANSWER, 4), m.chat(SHORT_ANSWER, 4, ignore_eos=True)
    assert longer.usage.completion_tokens == 4 >= plain.usage.completion_tokens


def _logprobs(m: Pinned) -> None:
    lp = m.complete(OPEN, temperature=1.0, logprobs=3).choices[0].logprobs
    # sampled: the end of the text may be drawn before the third token
    assert 0 < len(lp.tokens) <= 3 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert_most_likely(token, logprob, list(top.items()), 3, by_text=True)


def _structured_outputs(m: Pinned) -> None:
    assert re.fullmatch(r"\d{3}", m.text(OPEN, 4, structured_outputs={"regex": r"\d{3}"}))


def _prompt_logprobs(m: Pinned) -> None:
    lp = m.complete(OPEN, 1, echo=True, logprobs=1).choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.tokens) > 2


#: each option's effect, checked on a mode that claims it
CHECKS: dict[str, Callable[[Pinned], None]] = {
    "temperature": _temperature, "seed": _seed,
    "top_k": _restricts_to_the_likeliest(top_k=1), "top_p": _restricts_to_the_likeliest(top_p=1e-6),
    "min_p": _restricts_to_the_likeliest(min_p=1.0),
    "presence_penalty": _breaks_repetition(presence_penalty=2.0),
    "frequency_penalty": _breaks_repetition(frequency_penalty=2.0),
    "repetition_penalty": _repetition_penalty, "logit_bias": _logit_bias, "stop_token_ids": _stop_token_ids,
    "min_tokens": _min_tokens, "ignore_eos": _ignore_eos, "logprobs": _logprobs,
    "structured_outputs": _structured_outputs, "prompt_logprobs": _prompt_logprobs,
}
#: a request that sets each option (and what it needs besides), for the refusals
SETS: dict[str, dict] = {
    "temperature": {"temperature": 1.0}, "seed": {"temperature": 1.0, "seed": 1},
    "top_k": {"temperature": 1.0, "top_k": 5}, "top_p": {"temperature": 1.0, "top_p": 0.5},
    "min_p": {"temperature": 1.0, "min_p": 0.1}, "presence_penalty": {"presence_penalty": 1.0},
    "frequency_penalty": {"frequency_penalty": 1.0}, "repetition_penalty": {"repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {str(COMMA): 1}}, "stop_token_ids": {"stop_token_ids": [COMMA]},
    "min_tokens": {"min_tokens": 1}, "ignore_eos": {"ignore_eos": True}, "logprobs": {"logprobs": 1},
    "structured_outputs": {"structured_outputs": {"regex": "a"}},
    "prompt_logprobs": {"echo": True, "logprobs": 1, "max_tokens": 1},
}


def test_every_option_has_a_check_and_a_request():
    assert CHECKS.keys() == SETS.keys() == OPTIONS


def _refused(m: Pinned, option: str) -> None:
    options = dict(SETS[option])
    with pytest.raises(BadRequestError) as exc:
        m.complete(OPEN, options.pop("max_tokens", 2), **options)
    assert exc.value.param == "mode" and option in exc.value.message


# ---------------------------------------------------------------------------------------------- the docs table
PAGE = ROOT / "docs" / "options.md"
COLUMNS = sorted(OPTIONS)


def row(card: dict) -> str:
    """A mode's line of the table: each option honoured (yes) or refused (400), from its card."""
    if card["status"] != "available":
        return f"| `{card['name']}` | " + " | ".join("–" for _ in COLUMNS) + " |"
    return f"| `{card['name']}` | " + " | ".join("yes" if o in card["honours"] else "400" for o in COLUMNS) + " |"


def table(cards: list[dict]) -> str:
    head = "| mode | " + " | ".join(f"`{o}`" for o in COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS)
    return "\n".join([head, *(row(c) for c in sorted(cards, key=lambda c: c["name"]))])


def section(backend: str) -> re.Pattern:
    return re.compile(rf"(<!-- matrix:{backend} -->\n)(.*?)(<!-- /matrix:{backend} -->)", re.DOTALL)


def documented_rows(backend: str) -> dict[str, str]:
    found = section(backend).search(PAGE.read_text(encoding="utf-8"))
    assert found, f"docs/options.md has no matrix:{backend} section"
    return {line.split("`")[1]: line for line in found.group(2).splitlines() if line.startswith("| `")}


def stale_rows(backend: str, cards: list[dict]) -> list[str]:
    """The modes available here whose row on the page is not their card's. The page is written on one machine:
    a mode unavailable there (its row all "–", e.g. vLLM's GPTQ modes without AVX-512) is not compared where it
    is available, nor one unavailable here. ``MODESWITCH_WRITE_MATRIX=1`` rewrites the section first."""
    if os.environ.get("MODESWITCH_WRITE_MATRIX") == "1":
        text = PAGE.read_text(encoding="utf-8")
        PAGE.write_text(section(backend).sub(lambda m: m.group(1) + table(cards) + "\n" + m.group(3), text),
                        encoding="utf-8")
    documented = documented_rows(backend)
    unavailable_there = {name for name, line in documented.items() if "yes" not in line and "400" not in line}
    return [c["name"] for c in cards if c["status"] == "available" and c["name"] not in unavailable_there
            and documented.get(c["name"]) != row(c)]


def check_matrix(url: str, backend: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    cards = requests.get(url + "/v1/modes", timeout=30).json()["modes"]
    failures = []
    for card in (c for c in cards if c["status"] == "available"):
        m = Pinned(client, card["name"], frozenset(card["honours"]))
        for option in COLUMNS:
            try:
                if option in card["honours"]:
                    CHECKS[option](m)
                else:
                    _refused(m, option)
            except Exception as exc:  # every failing pair is reported, not just the first
                failures.append(f"{card['name']} x {option}: {type(exc).__name__}: {str(exc)[:300]}")
    stale = stale_rows(backend, cards)
    assert not failures, "\n".join(failures)
    assert not stale, f"docs/options.md ({backend}) differs from /v1/modes for {stale}: rerun with " \
                      "MODESWITCH_WRITE_MATRIX=1"


def test_every_option_pinned_to_every_transformers_mode(server):
    check_matrix(server.url, "transformers")


def test_every_option_pinned_to_every_vllm_mode(vllm_server):
    check_matrix(vllm_server, "vllm")
