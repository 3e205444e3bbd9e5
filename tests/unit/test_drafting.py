"""N-gram drafting bounded per request (modeswitch.engines.vllm.drafting), without an engine."""

from __future__ import annotations

import pytest
import torch

from modeswitch.engines.vllm.draft_budget import DraftBudget
from modeswitch.engines.vllm.drafting import DRAFT_TOKENS_KEY, bounded_drafts, draft_limit, expand


class Params:
    def __init__(self, extra_args=None) -> None:
        self.extra_args = extra_args


def test_each_request_drafts_at_most_its_bound_and_none_proposes_nothing():
    seen = []

    def propose(rows):
        seen.append(rows)
        return [[9, 8, 7, 6, 5] if ids else [] for ids in rows]

    limits = [draft_limit(Params({DRAFT_TOKENS_KEY: 0})), draft_limit(Params({DRAFT_TOKENS_KEY: 2})),
              draft_limit(Params())]
    assert limits == [0, 2, None]
    assert bounded_drafts(propose, limits, [[1], [2], [3]]) == [[], [9, 8], [9, 8, 7, 6, 5]]
    assert seen == [[[], [2], [3]]]  # the row that may not draft is not looked up at all


def test_expand_repeats_each_value_over_its_tokens_in_its_own_dtype():
    """vLLM's expand kernel: temperatures (float) per drafted token, greedy's 0 replaced by 1."""
    out = torch.empty(6, dtype=torch.float32)
    expand(out, torch.tensor([0.0, 0.9, 0.5]), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
    assert out.tolist() == [1.0, 1.0, 0.8999999761581421, 0.8999999761581421, 0.8999999761581421, 0.5]
    ints = torch.empty(3, dtype=torch.int64)
    expand(ints, torch.tensor([4, 7]), torch.tensor([0, 3], dtype=torch.int32), 0, 0)  # a request with no tokens
    assert ints.tolist() == [7, 7, 7]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(budget: DraftBudget, clock: Clock, cost, steps: int, ids, accepted: dict[str, int]) -> list:
    """``steps`` steps of requests ``ids``: each computes its rows plus the drafts proposed before and takes
    ``cost(tokens)`` seconds; request r accepts ``accepted[r]`` of its drafts. As n-grams are found or not, a
    request is proposed up to its limit, fewer on some steps."""
    limits = []
    for step in range(steps):
        tokens = len(ids) + sum(budget.proposed.get(r, 0) for r in ids)
        clock.now += cost(tokens)
        sampled = [[1] * (1 + min(accepted.get(r, 0), budget.proposed.get(r, 0))) for r in ids]
        budget.step(ids, sampled, tokens)
        limits = budget.limits(ids, [5] * len(ids))
        budget.proposing(ids, [[7] * min(k, (step + i) % 7) for i, k in enumerate(limits)])
    return limits


def test_a_budget_drafts_every_bound_until_it_has_measured_steps():
    budget = DraftBudget(clock=Clock())
    assert budget.limits(["a", "b", "c"], [5, 0, None]) == [5, 0, None]


def test_where_a_drafted_token_costs_nothing_every_request_drafts_its_bound():
    """As on a GPU: a step takes the same time whatever it verifies."""
    clock = Clock()
    budget = DraftBudget(clock=clock)
    ids = [f"r{i}" for i in range(8)]
    limits = run_steps(budget, clock, lambda tokens: 0.02, 40, ids, {})  # nothing is ever accepted
    assert budget.line.per_token() == pytest.approx(0.0, abs=1e-9)
    assert limits == [5] * 8


def test_where_each_token_costs_a_busy_batch_drafts_only_for_the_requests_that_copy():
    """As on a CPU: every token verified costs 10 ms. Eight requests, one copying its prompt (its drafts accepted):
    only that one keeps drafting; the others' drafts, never accepted, would slow every request in the step."""
    clock = Clock()
    budget = DraftBudget(clock=clock)
    ids = [f"r{i}" for i in range(8)]
    limits = run_steps(budget, clock, lambda tokens: 0.1 + 0.01 * tokens, 60, ids, {"r0": 5})
    assert budget.line.per_token() == pytest.approx(0.01, rel=0.05)
    assert limits[0] >= 3 and limits[1:] == [0] * 7


def test_a_lone_request_drafts_on_the_same_machine_where_a_busy_batch_would_not():
    """The same cost per token: alone, a request of middling acceptance drafts, as a step of one costs little."""
    clock = Clock()
    budget = DraftBudget(clock=clock)
    cost = lambda tokens: 0.1 + 0.01 * tokens  # noqa: E731
    run_steps(budget, clock, cost, 30, [f"r{i}" for i in range(8)], {})  # measured on a busy batch
    assert run_steps(budget, clock, cost, 10, ["lone"], {"lone": 2})[0] >= 2


def test_an_idle_spell_is_not_measured_as_a_step():
    clock = Clock()
    budget = DraftBudget(clock=clock)
    budget.step(["a"], [[1]], 1)
    budget.proposing(["a"], [[]])
    clock.now += 30.0  # the engine idles, then a new request comes
    budget.step(["b"], [[1]], 100)
    assert budget.line.steps == 0
    budget.proposing(["b"], [[]])
    clock.now += 0.05
    budget.step(["b"], [[1]], 1)
    assert budget.line.steps == 1
