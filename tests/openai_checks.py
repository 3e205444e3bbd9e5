"""Checks of OpenAI's meaning that more than one test file asks of a response."""

from __future__ import annotations

import json
from typing import Iterator


def assert_most_likely(token: str, logprob: float, top: list[tuple[str, float]], k: int, by_text: bool = False) -> None:
    """OpenAI's ``top_logprobs`` at one position: the ``k`` most likely tokens, most likely first, each <= 0; the
    chosen token's logprob is its entry's when it is among them, and no higher than the last one's when it is not.
    This holds whichever token sampling chose (vLLM's own server lists the chosen token first instead).
    ``by_text``: the completions API's form, a dict by token text, where two token ids that decode to the same
    text share one key (so it may hold fewer than ``k``)."""
    values = [v for _, v in top]
    assert (0 < len(top) <= k if by_text else len(top) == k), top
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values), top
    # two token ids may decode to the same text: a chosen token that is not listed ranks below the k listed
    assert logprob in [v for t, v in top if t == token] or logprob <= values[-1], (token, logprob, top)


def chunks(resp) -> Iterator[dict]:
    """A streamed completion's chunks, as they arrive (``resp`` opened with ``stream=True``)."""
    return (json.loads(line[len(b"data: "):]) for line in resp.iter_lines() if line.startswith(b"data: {"))


def generating(resp, within: int = 6) -> bool:
    """Whether one of the stream's first ``within`` chunks carries a token's text: the head chunk's text is empty,
    sent before the server has counted any token."""
    stream = chunks(resp)
    return any(next(stream)["choices"][0]["text"] for _ in range(within))
