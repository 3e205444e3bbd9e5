"""How many tokens each request of a speculating vLLM engine drafts this step: as many as pay, by what this
engine measures, instead of every request its bound whatever the batch.

A drafted token costs the whole batch its share of the verify step; it pays only when the tokens it is expected
to add are worth more than that time. Both sides are measured in the engine process, online:

- the step's cost by the tokens it computes: a running least-squares line ``seconds = t0 + c * tokens`` over the
  engine's own steps (a GPU verifies a few more tokens for almost nothing, c ~ 0; a CPU computing every token
  pays c each, more so the larger the batch);
- each request's acceptance: the chance that its next drafted token is accepted (n-gram drafts stop at the first
  rejection, so a step that accepted ``a`` of ``d`` drafts counts ``a`` accepted of ``a + (a < d)`` tried), from
  its own recent steps. A new request starts from even odds worth two tries (``PRIOR_*``), which its own steps
  outweigh within a few; the prior is there so that every request is tried, not as a guess of its worth.

Each step, drafted tokens are added greedily, the most likely to be accepted first (the j-th draft of a request
of acceptance p adds p**j tokens, expected): one is added while its expected tokens per second (p**j / c) beat
the step's tokens per second so far. So a lone request drafts its whole bound; a busy CPU engine drafts only for
the requests that copy their prompts; a GPU drafts as before. Each request's own bound
(:data:`~.drafting.DRAFT_TOKENS_KEY`) still caps it, and greedy output is the same whatever is drafted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

#: the weight of a new sample in the step line's running sums (about the last hundred steps), and how much of a
#: request's acceptance each of its steps lets fade (about its last twenty)
STEP_WEIGHT = 0.01
ACCEPT_WEIGHT = 0.05
#: what a request's acceptance starts from (even odds, worth two tried tokens) and drifts back to while it drafts
#: nothing
PRIOR_ACCEPTANCE = 0.5
PRIOR_TRIES = 2.0
#: steps measured before the line is trusted (until then every request drafts its bound)
MIN_STEPS = 16


@dataclass
class StepLine:
    """A running least-squares line of a step's seconds against the tokens it computed, from decaying sums of the
    moments. Not the learned policy's recursive least squares (``controller.online``): from the moments it can tell
    that the slope is not known yet (every step the same size), where the recursive fit's prior would make one up
    and charge the whole step to its tokens."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        w = max(STEP_WEIGHT, 1.0 / (self.steps + 1))
        keep = 1.0 - w
        self.n = self.n * keep + w
        self.sx = self.sx * keep + w * tokens
        self.sy = self.sy * keep + w * seconds
        self.sxx = self.sxx * keep + w * tokens * tokens
        self.sxy = self.sxy * keep + w * tokens * seconds
        self.steps += 1

    def per_token(self) -> float | None:
        """Seconds one more token adds to a step (never below 0); None until enough steps of different sizes."""
        var = self.sxx / self.n - (self.sx / self.n) ** 2 if self.n else 0.0
        if self.steps < MIN_STEPS or var <= 1e-9:
            return None
        return max((self.sxy / self.n - self.sx * self.sy / self.n ** 2) / var, 0.0)

    def at(self, tokens: float) -> float:
        """The line's seconds for a step of ``tokens`` (its intercept from the means and the slope)."""
        c = self.per_token() or 0.0
        return max(self.sy / self.n + c * (tokens - self.sx / self.n), 1e-6) if self.n else 1e-6


@dataclass
class _Acceptance:
    """One request's accepted and tried drafted tokens, decaying every step it runs, drafting or not: a request
    that stopped drafting drifts back to the prior and tries again now and then (its text may turn to quoting)."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def p(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_TRIES) / (self.tried + PRIOR_TRIES)

    def add(self, accepted: int, tried: int) -> None:
        keep = 1.0 - ACCEPT_WEIGHT
        self.accepted = self.accepted * keep + accepted
        self.tried = self.tried * keep + tried


@dataclass
class DraftBudget:
    """One speculating engine's step line, acceptances and the drafts proposed last step (see the module doc)."""

    clock: Callable[[], float] = time.perf_counter
    line: StepLine = field(default_factory=StepLine)
    requests: dict[str, _Acceptance] = field(default_factory=dict)
    #: request id -> the drafts it was proposed last step
    proposed: dict[str, int] = field(default_factory=dict)
    #: when the last step's drafts were proposed, and the ids in that step
    _last: tuple[float, frozenset[str]] | None = None

    def step(self, ids: Sequence[str], sampled: Sequence[Sequence[int]], tokens: int) -> None:
        """A step ended: ``sampled[i]`` are the tokens request ``ids[i]`` got from it, ``tokens`` what it computed.
        Learns each request's acceptance from the drafts it was proposed before, and the step's time (only when a
        request ran in the step before too: after an idle spell the gap is not a step)."""
        now, last = self.clock(), self._last
        if last is not None and last[1].intersection(ids):
            self.line.add(tokens, now - last[0])
        for rid, got in zip(ids, sampled):
            own = self.requests.setdefault(rid, _Acceptance())
            drafted = self.proposed.get(rid, 0)
            if drafted > 0 and got:
                accepted = min(len(got) - 1, drafted)
                own.add(accepted, accepted + (accepted < drafted))
            else:
                own.add(0, 0)  # what it showed before fades

    def limits(self, ids: Sequence[str], bounds: Sequence[int | None]) -> list[int | None]:
        """Each request's drafts this step: at most its bound (None: as vLLM would, not counted here), as many as
        pay while the line is measured; its bound while it is not."""
        c = self.line.per_token()
        if c is None:
            return list(bounds)
        out: list[int | None] = [None if b is None else 0 for b in bounds]
        rows = len(ids)
        seconds, tokens = self.line.at(rows), float(rows)
        drafts = []  # (expected tokens, row) for each draft a request may have, best first
        for i, (rid, bound) in enumerate(zip(ids, bounds)):
            if bound:
                own = self.requests.get(rid)
                p = own.p if own is not None else _Acceptance().p
                drafts += [(p ** j, i) for j in range(1, bound + 1)]
        drafts.sort(key=lambda d: -d[0])
        for gain, i in drafts:
            if c > 0 and gain * seconds <= c * tokens:  # its tokens per second no better than the step's so far
                break
            out[i] += 1  # type: ignore[operator]
            seconds, tokens = seconds + c, tokens + gain
        return out

    def proposing(self, ids: Sequence[str], drafts: Sequence[Sequence[int]]) -> None:
        """The drafts proposed for this step's requests (what the next step's acceptance is read against)."""
        self.proposed = {rid: len(d) for rid, d in zip(ids, drafts)}
        self.requests = {rid: a for rid, a in self.requests.items() if rid in self.proposed}
        self._last = (self.clock(), frozenset(ids))
