"""What drafting would do for a request: its predicted n-gram acceptance (tokens per target step), learned
online from every completed request. What a drafting step costs is measured per engine (:mod:`.costs`).

Prompt-lookup drafting (vLLM's ``ngram`` method, transformers' ``prompt_lookup_num_tokens``) proposes the tokens
that followed the latest earlier occurrence of the context's last n-gram. How many of them the target accepts
depends on how much of the answer copies the prompt (quoting, editing code, repeating a list: most; free prose:
little). That is known only after the answer, but then exactly: :func:`ngram_steps` replays the drafting over the
prompt and the answer a request got, whatever mode served it, and gives the target steps it would have taken. So
every completed request teaches the model, not only the speculative ones, and no request is sent to a speculative
mode just to find out. The prediction for a new request is the running mean over earlier requests of its kind:
its task family, its prompt length (log2 buckets) and how repetitive its prompt is (the share of its last 256
tokens' trigrams seen earlier in them: lists, code and tables repeat their own structure); a kind not seen yet is
predicted to gain nothing. Computing the kind costs a few microseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from ..modes import NGRAM_MAX, NGRAM_MIN
from .completed import Completed

#: weight of each new observation in the running means (about the last ten of a kind)
WEIGHT = 0.1
#: the tail of the prompt whose trigram repetition is measured (bounds the cost of the feature)
REPEAT_WINDOW = 256
#: draft tokens per step the replay assumes until the server says what its speculative modes propose
REPLAY_K = 5


def prompt_repeat(prompt_ids: Sequence[int]) -> float:
    """The share of the prompt tail's trigrams that occur earlier in it (0: none repeats)."""
    tail = prompt_ids[-REPEAT_WINDOW:]
    total = len(tail) - 2
    if total <= 0:
        return 0.0
    return 1.0 - len(set(zip(tail, tail[1:], tail[2:]))) / total


def ngram_steps(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int = REPLAY_K,
                n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> int:
    """Target steps prompt-lookup drafting of ``k`` tokens would take to produce ``output_ids`` after
    ``prompt_ids`` greedily: each step proposes the ``k`` tokens that followed the latest earlier occurrence of
    the longest matching suffix n-gram (``n_max`` down to ``n_min``), accepts the proposal's agreeing prefix,
    and adds one token of its own."""
    seq = list(prompt_ids) + list(output_ids)
    start, end = len(prompt_ids), len(seq)
    last: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]  # n -> n-gram -> index after its latest end

    def index_upto(hi: int, lo: int) -> None:  # record n-grams ending before position hi, from lo on
        for j in range(lo, hi):
            for n in range(n_min, n_max + 1):
                if j - n + 1 >= 0:
                    last[n][tuple(seq[j - n + 1:j + 1])] = j + 1

    indexed = 0
    pos, steps = start, 0
    while pos < end:
        # n-grams that end before the current suffix's last token: an occurrence strictly earlier
        index_upto(pos - 1, indexed)
        indexed = max(indexed, pos - 1)
        accepted = 0
        for n in range(n_max, n_min - 1, -1):
            if pos - n < 0:
                continue
            at = last[n].get(tuple(seq[pos - n:pos]))
            if at is not None:
                while accepted < k and pos + accepted < end and at + accepted < pos and seq[at + accepted] == seq[pos + accepted]:
                    accepted += 1
                break
        pos += accepted + 1
        steps += 1
    return steps


def tokens_per_step(tokens: int, target_steps: int | None) -> float | None:
    """A speculative request's tokens per target step after its first token (what its time per output token
    spans), or None when it did not draft or made too few steps to say."""
    return (tokens - 1) / (target_steps - 1) if target_steps and target_steps > 1 and tokens > 1 else None


@dataclass(frozen=True, slots=True)
class Kind:
    task: str
    length: int   # log2 bucket of the prompt tokens
    repeat: int   # prompt_repeat in quarters

    @classmethod
    def of(cls, task: str, prompt_tokens: int, repeat: float) -> "Kind":
        return cls(task, max(prompt_tokens, 1).bit_length(), min(int(repeat * 4), 3))


class _Mean:
    """A running mean that weighs recent observations more (exact while there are few)."""

    __slots__ = ("value", "count")

    def __init__(self) -> None:
        self.value, self.count = 0.0, 0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) * max(WEIGHT, 1.0 / self.count)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What the model expects of drafting for one request: its prompt's repetition and the tokens per target
    step drafting would yield."""
    repeat: float
    tokens_per_step: float


class SpeculationModel:
    """Acceptance by kind of request, from completed requests (an observer of the controller); :meth:`estimate`
    is what a request's features read."""

    def __init__(self) -> None:
        self.k = REPLAY_K
        self._accept: dict[Kind, _Mean] = {}
        self._overall = _Mean()
        self._lock = threading.Lock()

    def bind(self, k: int = REPLAY_K) -> None:
        """The tokens the resident speculative modes propose a step (what the replay drafts). What was learned
        is kept."""
        self.k = k

    def tokens_per_step(self, kind: Kind) -> float:
        """The running mean for requests of this kind; 1 (drafting gains nothing) for a kind not seen yet: a
        request is not sent to drafting on another kind's evidence, and its own replay teaches the model
        whichever mode serves it."""
        mean = self._accept.get(kind)
        return mean.value if mean is not None and mean.count else 1.0

    def estimate(self, prompt_ids: Sequence[int], task: str) -> Estimate:
        repeat = prompt_repeat(prompt_ids)
        return Estimate(repeat, self.tokens_per_step(Kind.of(task, len(prompt_ids), repeat)))

    def observe(self, completed: Completed) -> None:
        """Learn acceptance from the replay of any finished generation."""
        if completed.outcome != "ok" or completed.scoring or completed.completion_tokens < 2:
            return
        f = completed.features
        steps = ngram_steps(completed.prompt_ids, completed.output_ids, self.k)
        tau = len(completed.output_ids) / max(steps, 1)
        with self._lock:
            self._accept.setdefault(Kind.of(f.task, f.prompt_tokens, f.prompt_repeat), _Mean()).add(tau)
            self._overall.add(tau)

    def describe(self) -> dict:
        """What ``/v1/modes`` shows: acceptance learned per kind."""
        with self._lock:
            return {"tokens_per_step": {f"{k.task}/2^{k.length}/repeat{k.repeat}": round(m.value, 3)
                                        for k, m in self._accept.items()},
                    "overall_tokens_per_step": round(self._overall.value, 3), "requests": self._overall.count}
