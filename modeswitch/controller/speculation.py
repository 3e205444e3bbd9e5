"""When drafting pays: a request's predicted n-gram acceptance, and its expected speed-up on a speculative mode
at the load it would meet (goodput), learned online from every completed request.

Acceptance. Prompt-lookup drafting (vLLM's ``ngram`` method, transformers' ``prompt_lookup_num_tokens``)
proposes the tokens that followed the latest earlier occurrence of the context's last n-gram. How many of them
the target accepts depends on how much of the answer copies the prompt (quoting, editing code, repeating a
list: most; free prose: little). That is known only after the answer, but then exactly: :func:`ngram_steps`
replays the drafting over the prompt and the answer a request got, whatever mode served it, and gives the
target steps it would have taken. So every completed request teaches the model, not only the speculative
ones, and no request is sent to a speculative mode just to find out. The prediction for a new request is the
running mean over earlier requests of its kind: its task family, its prompt length (log2 buckets) and how
repetitive its prompt is (the share of its last 256 tokens' trigrams seen earlier in them: lists, code and
tables repeat their own structure); a kind not seen yet is predicted to gain nothing. Computing the kind costs
a few microseconds.

Goodput. A drafting step verifies several tokens per request, so it costs more than a plain step, and more
as the batch grows; and a request's step time depends on the load of the compute it runs on. Engines run in
*lanes*: the cores (or device) their model runs on. On a CPU the vLLM backend gives each engine its own cores
where it can (``backends.vllm``), so a request sent to the speculative engine while the plain batch is busy does
not wait for the plain batch's steps; on a GPU every engine shares one lane. Per batch and lane load (requests
in flight on the lane when the request was decided, in buckets) the model keeps the seconds per step it
measured (per target step for a drafting batch, per token for a plain one). A request's expected speed-up on a
speculative mode is then ``acceptance x plain step(plain lane load + 1) / drafting step(its lane load + 1)``.
Where a bucket has not been measured on both batches, steps are assumed to take :data:`PRIOR_STEP_COST` times
longer when drafting, and to grow in proportion to the requests on the lane: a burst is spread over lanes
before the first measurement comes in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

from .completed import Completed

#: a drafting step's cost relative to a plain step where the model has not measured both at a load yet
PRIOR_STEP_COST = 1.15
#: weight of each new observation in the running means (about the last ten of a kind)
WEIGHT = 0.1
#: the tail of the prompt whose trigram repetition is measured (bounds the cost of the feature)
REPEAT_WINDOW = 256
#: draft tokens per step the replay assumes until the server says what its speculative modes propose, and the
#: n-gram sizes it matches (vLLM's ngram method as the vLLM backend configures it)
REPLAY_K, NGRAM_MIN, NGRAM_MAX = 5, 2, 4


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


def _bucket(load: int) -> int:
    """Load buckets: 1, 2-3, 4-7, 8-15, 16+ requests on a lane."""
    return min(load.bit_length(), 5)


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
    """What the model expects of drafting for one request: its prompt's repetition, the tokens per target step
    drafting would yield, and per speculative mode the expected speed-up over its plain batch at this load."""
    repeat: float
    tokens_per_step: float
    gain: Mapping[str, float]

    @property
    def best_gain(self) -> float:
        return max(self.gain.values(), default=0.0)


class SpeculationModel:
    """Acceptance by kind of request and step costs by load, from completed requests (an observer of the
    controller); :meth:`estimate` is what a decision reads. ``pairs``: each speculative mode's batch and the plain
    batch on the same weights it is compared with."""

    def __init__(self) -> None:
        self.pairs: dict[str, tuple[str, str]] = {}
        self.batches: dict[str, str] = {}  # mode -> its batch
        self.lanes: dict[str, str] = {}  # mode -> the lane its engine computes on
        self._batch_lane: dict[str, str] = {}
        self.speculative_batches: set[str] = set()
        self.k = REPLAY_K
        self._accept: dict[Kind, _Mean] = {}
        self._overall = _Mean()
        self._seconds: dict[tuple[str, int], _Mean] = {}  # (batch, load bucket) -> s/step (drafting) or s/token
        self._lock = threading.Lock()

    def bind(self, pairs: Mapping[str, tuple[str, str]], batches: Mapping[str, str], k: int = REPLAY_K,
             lanes: Mapping[str, str] | None = None) -> None:
        """The resident modes: per speculative mode (its batch, the plain batch on its weights), every mode's
        batch, the tokens the speculative modes propose a step, and every mode's lane (default: one for all).
        What was learned is kept."""
        self.pairs, self.batches, self.k = dict(pairs), dict(batches), k
        self.lanes = dict(lanes or {})
        self._batch_lane = {b: self.lanes.get(m, "") for m, b in self.batches.items()}
        self.speculative_batches = {b for b, _ in self.pairs.values()}

    def tokens_per_step(self, kind: Kind) -> float:
        """The running mean for requests of this kind; 1 (drafting gains nothing) for a kind not seen yet: a
        request is not sent to drafting on another kind's evidence, and its own replay teaches the model
        whichever mode serves it."""
        mean = self._accept.get(kind)
        return mean.value if mean is not None and mean.count else 1.0

    def lane_load(self, batch: str, in_flight_by_mode: Mapping[str, int]) -> int:
        """Requests in flight on the lane ``batch`` computes on (every lane's, where lanes are not known)."""
        lane = self._batch_lane.get(batch, "")
        return sum(n for m, n in in_flight_by_mode.items() if self.lanes.get(m, "") == lane)

    def step_seconds(self, batch: str, load: int) -> float | None:
        mean = self._seconds.get((batch, _bucket(load)))
        return mean.value if mean is not None and mean.value > 0 else None

    def speedup(self, spec: str, plain: str, tau: float, in_flight_by_mode: Mapping[str, int]) -> float:
        """Expected time per token on the plain batch over that on the drafting one, each at its lane's load
        with this request added (measured where both are, else the prior: see the module's docstring)."""
        n_spec = self.lane_load(spec, in_flight_by_mode) + 1
        n_plain = self.lane_load(plain, in_flight_by_mode) + 1
        drafting, base = self.step_seconds(spec, n_spec), self.step_seconds(plain, n_plain)
        if drafting is None or base is None:
            return tau * n_plain / (n_spec * PRIOR_STEP_COST)
        return tau * base / drafting

    def estimate(self, prompt_ids: Sequence[int], task: str, in_flight_by_mode: Mapping[str, int]) -> Estimate:
        repeat = prompt_repeat(prompt_ids)
        tau = self.tokens_per_step(Kind.of(task, len(prompt_ids), repeat))
        gain = {mode: self.speedup(spec, plain, tau, in_flight_by_mode) for mode, (spec, plain) in self.pairs.items()}
        return Estimate(repeat, tau, gain)

    def observe(self, completed: Completed) -> None:
        """Learn acceptance from the replay of any finished generation, and step costs from its timings."""
        if completed.outcome != "ok" or completed.scoring or completed.completion_tokens < 2:
            return
        f = completed.features
        steps = ngram_steps(completed.prompt_ids, completed.output_ids, self.k)
        tau = len(completed.output_ids) / max(steps, 1)
        batch = self.batches.get(completed.mode)
        with self._lock:
            mean = self._accept.setdefault(Kind.of(f.task, f.prompt_tokens, f.prompt_repeat), _Mean())
            mean.add(tau)
            self._overall.add(tau)
            if batch is None or completed.retried or completed.tpot_s is None:
                return
            seconds = completed.tpot_s
            if batch in self.speculative_batches:  # per target step
                per_step = tokens_per_step(completed.completion_tokens, completed.target_steps)
                if per_step is None:
                    return
                seconds *= per_step
            load = self.lane_load(batch, f.in_flight_by_mode) + 1  # as it was decided: this request joining
            self._seconds.setdefault((batch, _bucket(load)), _Mean()).add(seconds)

    def describe(self) -> dict:
        """What ``/v1/modes`` shows: acceptance learned per kind, and step seconds per batch and load bucket."""
        with self._lock:
            return {"tokens_per_step": {f"{k.task}/2^{k.length}/repeat{k.repeat}": round(m.value, 3)
                                        for k, m in self._accept.items()},
                    "overall_tokens_per_step": round(self._overall.value, 3), "requests": self._overall.count,
                    "step_seconds": {f"{b}@load{2 ** (lb - 1) if lb else 0}+": round(m.value, 5)
                                     for (b, lb), m in self._seconds.items()}}
