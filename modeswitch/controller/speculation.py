"""What drafting would do for a request: its predicted n-gram acceptance (tokens per target step), learned
online from every completed request. What a drafting step costs is measured per engine (:mod:`.costs`).

Prompt-lookup drafting (vLLM's ``ngram`` method, transformers' ``prompt_lookup_num_tokens``) proposes the tokens
that followed the latest earlier occurrence of the context's last n-gram. How many of them the target accepts
depends on how much of the answer copies the prompt (quoting, editing code, repeating a list: most; free prose:
little). That is known only after the answer, but then exactly: :func:`ngram_replay` replays the drafting over the
prompt and the answer a request got, whatever mode served it, and gives the target steps it would have taken and the
tokens it would have drafted (what those steps verify: a step that verifies five drafts costs more than one that
verifies none, and prose that matches often but is seldom right drafts many tokens for little gain). So
every completed request teaches the model, not only the speculative ones, and no request is sent to a speculative
mode just to find out. The prediction for a new request is the running mean over earlier requests of its kind:
its task family, its prompt length (log2 buckets) and how repetitive its prompt is (the share of its last 256
tokens' trigrams seen earlier in them: lists, code and tables repeat their own structure); a kind not seen yet is
predicted to gain nothing (and its drafting step is priced at what its engine's drafting requests cost on the
whole). Computing the kind costs a few microseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..modes import NGRAM_MAX, NGRAM_MIN
from .completed import Completed
from .features import Kind

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


class Replay(NamedTuple):
    """What prompt-lookup drafting would have done for one answer: its target steps, and the tokens it drafted over
    them (each proposal as proposed, accepted or not)."""

    steps: int
    drafted: int


def ngram_replay(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int = REPLAY_K,
                 n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> Replay:
    """Prompt-lookup drafting of ``k`` tokens replayed over ``output_ids`` after ``prompt_ids``, greedily: each step
    proposes the (up to) ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix
    n-gram (``n_max`` down to ``n_min``), accepts the proposal's agreeing prefix, and adds one token of its own."""
    seq = list(prompt_ids) + list(output_ids)
    start, end = len(prompt_ids), len(seq)
    last: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]  # n -> n-gram -> index after its latest end

    def index_upto(hi: int, lo: int) -> None:  # record n-grams ending before position hi, from lo on
        for j in range(lo, hi):
            for n in range(n_min, n_max + 1):
                if j - n + 1 >= 0:
                    last[n][tuple(seq[j - n + 1:j + 1])] = j + 1

    indexed = 0
    pos, steps, drafted = start, 0, 0
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
                drafted += min(k, pos - at)  # what followed it, as far as the context goes
                while accepted < k and pos + accepted < end and at + accepted < pos and seq[at + accepted] == seq[pos + accepted]:
                    accepted += 1
                break
        pos += accepted + 1
        steps += 1
    return Replay(steps, drafted)


def tokens_per_step(tokens: int, target_steps: int | None) -> float | None:
    """A speculative request's tokens per target step after its first token (what its time per output token
    spans), or None when it did not draft or made too few steps to say."""
    return (tokens - 1) / (target_steps - 1) if target_steps and target_steps > 1 and tokens > 1 else None


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
    """What the model expects of drafting for one request: its prompt's repetition, the tokens per target step
    drafting would yield, and the tokens it would draft a target step (None: no request of its kind seen yet)."""
    repeat: float
    tokens_per_step: float
    drafts_per_step: float | None = None


class SpeculationModel:
    """Acceptance by kind of request, from completed requests (an observer of the controller); :meth:`estimate`
    is what a request's features read."""

    def __init__(self) -> None:
        self.k = REPLAY_K
        self._accept: dict[Kind, _Mean] = {}
        self._drafted: dict[Kind, _Mean] = {}  # the tokens drafted a target step, by the same replays
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
        kind = Kind.of(task, len(prompt_ids), repeat)
        drafted = self._drafted.get(kind)
        return Estimate(repeat, self.tokens_per_step(kind), drafted.value if drafted is not None else None)

    def observe(self, completed: Completed) -> None:
        """Learn acceptance and the tokens drafted from the replay of any finished generation."""
        if completed.outcome != "ok" or completed.scoring or completed.completion_tokens < 2:
            return
        replay = ngram_replay(completed.prompt_ids, completed.output_ids, self.k)
        steps = max(replay.steps, 1)
        tau = len(completed.output_ids) / steps
        kind = completed.features.kind
        with self._lock:
            self._accept.setdefault(kind, _Mean()).add(tau)
            self._drafted.setdefault(kind, _Mean()).add(replay.drafted / steps)
            self._overall.add(tau)

    def describe(self) -> dict:
        """What ``/v1/modes`` shows: acceptance and tokens drafted learned per kind."""
        with self._lock:
            return {"tokens_per_step": {k.name: round(m.value, 3) for k, m in self._accept.items()},
                    "drafts_per_step": {k.name: round(m.value, 3) for k, m in self._drafted.items()},
                    "overall_tokens_per_step": round(self._overall.value, 3), "requests": self._overall.count}
