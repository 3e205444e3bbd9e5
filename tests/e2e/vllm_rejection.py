"""vLLM's verify step on n-gram drafts, run by its own sampler and rejection sampler code on a CPU, for
``test_openai_params.py``: reads a JSON list of cases (``logits``: the target's rows, the drafted positions' then the
bonus position's; ``drafts``; ``seed``; ``temperature``; ``top_p`` or null) from stdin and writes each case's tokens.

It runs in its own interpreter because vLLM's CPU platform registers its kernel stand-ins by scanning every loaded
module's attributes, which the Flask proxies of the test process refuse to be asked about. ModeSwitch's fix of the
rejection sampler's ``expand_kernel`` stand-in is applied first, as in ModeSwitch's engine workers
(:func:`modeswitch.engines.vllm.drafting.fix_cpu_expand`).
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, rejection_sample
from vllm.v1.sample.sampler import Sampler

from modeswitch.engines.vllm import drafting


def verify(logits: torch.Tensor, drafts: list[int], seed: int, temperature: float, top_p: float | None) -> list[int]:
    """The tokens vLLM's verify step yields for one request: its bonus token sampled first (as
    ``RejectionSampler.forward`` does), then the drafted positions accepted or corrected."""
    n = len(drafts)
    meta = SamplingMetadata(
        temperature=torch.tensor([temperature]), all_greedy=False, all_random=True,
        top_p=None if top_p is None else torch.tensor([top_p]), top_k=None,
        generators={0: torch.Generator().manual_seed(seed)}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(1), presence_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1), output_token_ids=[[]], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=[drafts])
    bonus = Sampler()(logits[n:].clone(), meta).sampled_token_ids.long()
    cu = torch.tensor([n], dtype=torch.int32)
    target = apply_sampling_constraints(logits[:n].clone(), cu, meta)
    out = rejection_sample(torch.tensor(drafts, dtype=torch.int32), [n], n, cu, None, target, bonus, meta)
    return [t for t in out[0].tolist() if t >= 0]


if __name__ == "__main__":
    drafting.fix_cpu_expand()
    current_platform.register_triton_kernel_overrides()
    cases = json.load(sys.stdin)
    json.dump([verify(torch.tensor(c["logits"]), c["drafts"], c["seed"], c["temperature"], c["top_p"])
               for c in cases], sys.stdout)
