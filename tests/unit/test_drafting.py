"""N-gram drafting bounded per request (modeswitch.engines.vllm.drafting), without an engine."""

from __future__ import annotations

import torch

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
