"""N-gram drafting as a per-request choice on a vLLM engine, loaded into every engine by :mod:`.plugin`.

A request's ``extra_args`` bound the tokens drafted for it a step (``DRAFT_TOKENS_KEY``; 0: none), so the
speculative and plain modes on one set of weights share one engine: its weights, KV pool, prefix cache and batch.
Within its bound a request drafts as many tokens as the engine measures to pay this step (:mod:`.draft_budget`).
vLLM drafts for every request of an engine started with a speculative config; a second engine only to speculate
would hold another process, KV pool and copy of the weights.

A request that drafts nothing has every token sampled by vLLM's own sampler, as the step's "bonus" token, through
every logits processor, as on a plain engine. So the engines ModeSwitch starts keep vLLM's ``min_p`` and
``logit_bias`` processors when they speculate (vLLM leaves them out, as its rejection sampler does not apply them
to drafted positions), and only a request that drafts is refused those options. Requests without the key draft as
vLLM would; vLLM's own server, which never sets it, drafts as shipped.

On a CPU, vLLM's C++ stand-in for the rejection sampler's ``expand_kernel`` writes an int64 copy of its output,
so the per-token temperatures and top-p it expands come back as uninitialised memory: a speculating batch with a
sampled request in it produced garbage for every request in it (a greedy request's answer turned to noise after
one token). :func:`fix_cpu_expand` replaces it in ModeSwitch's engines. And the rejection sampler constrains its
drafted positions' logits by top-k even in a step where no request drafted: on a CPU, top-k alone then takes the
``max()`` of an empty tensor and the engine core dies (a sampled request with ``top_k`` and no ``top_p`` killed a
speculating engine); :func:`fix_empty_drafts` leaves an empty batch of drafted positions alone.

Every vLLM symbol replaced here is named in :mod:`.compat`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import compat
from .draft_budget import DraftBudget

#: the key of a request's ``extra_args`` that bounds the tokens drafted for it a step (0: none)
DRAFT_TOKENS_KEY = "modeswitch_draft_tokens"
#: the model runner's attribute holding its :class:`~.draft_budget.DraftBudget`
BUDGET_ATTR = "_modeswitch_draft_budget"


def draft_limit(sampling_params) -> int | None:
    """The draft tokens a request may get a step, as its ``extra_args`` bound them (None: as vLLM would)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    limit = extra.get(DRAFT_TOKENS_KEY)
    return None if limit is None else int(limit)


def sampled_rows(sampled: Any) -> list[list[int]]:
    """The tokens each batch row sampled this step, as lists, whatever vLLM hands over: lists (its n-gram path) or a
    2-D tensor padded with negative ids (its other paths). Anything else raises: a bound that cannot be applied
    must fail the step, never let a plain request draft unbounded (and :mod:`.compat` refuses, at start, a vLLM
    whose signature names another type)."""
    if isinstance(sampled, torch.Tensor):
        return [[t for t in row if t >= 0] for row in sampled.tolist()]
    if isinstance(sampled, (list, tuple)):
        return [list(row) for row in sampled]
    raise TypeError(f"cannot bound drafts: vLLM passed sampled tokens as {type(sampled).__name__}")


def bounded_drafts(propose: Callable[[list[list[int]]], list[list[int]]], limits: list[int | None],
                   sampled: list[list[int]]) -> list[list[int]]:
    """``propose(sampled)`` with each batch row's drafts cut to its limit; a row that may draft nothing is
    proposed nothing (the n-gram proposer skips rows with no sampled tokens)."""
    drafts = propose([ids if limit != 0 else [] for ids, limit in zip(sampled, limits)])
    return [list(d) if limit is None else list(d[:limit]) for d, limit in zip(drafts, limits)]


def _drafts_ngrams(speculative_config) -> bool:
    """Whether an engine with this speculative config drafts n-grams (the proposer these bounds apply to)."""
    return speculative_config is not None and speculative_config.method == "ngram"


def draft_per_request(modeswitch_engine: Callable[[object], bool]) -> None:
    """Bound each request's n-gram drafts by ``DRAFT_TOKENS_KEY`` (the engine's model runner), and let a request
    that drafts nothing use ``min_p`` and ``logit_bias`` on a speculating engine whose config
    ``modeswitch_engine`` accepts (the front end's check, the runner's logits processors). Idempotent."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    check = compat.original("validate_spec_decode")
    if getattr(check, "per_request", False):
        return

    def validate_spec_decode(self, speculative_config) -> None:
        if draft_limit(self) != 0:
            check(self, speculative_config)

    propose = compat.original("propose_drafts")

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if not _drafts_ngrams(self.speculative_config):
            return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        ids, sampled = list(self.input_batch.req_ids), sampled_rows(sampled_token_ids)
        budget = self.__dict__.setdefault(BUDGET_ATTR, DraftBudget())
        budget.step(ids, sampled, scheduler_output.total_num_scheduled_tokens)
        limits = budget.limits(ids, [draft_limit(self.requests[rid].sampling_params) for rid in ids])
        drafts = bounded_drafts(lambda rows: propose(self, scheduler_output, rows, *args, **kwargs), limits, sampled)
        budget.proposing(ids, drafts)
        return drafts

    build = compat.original("build_logitsprocs")

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if (not _drafts_ngrams(vllm_config.speculative_config) or not modeswitch_engine(vllm_config)
                or is_pooling_model or custom_logitsprocs):
            return build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    validate_spec_decode.per_request = True
    compat.replace("validate_spec_decode", validate_spec_decode)
    compat.replace("propose_drafts", propose_draft_token_ids)
    compat.replace("build_logitsprocs", build_logitsprocs)


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from, replace_to,
           MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's own parameter name)
    """vLLM's ``expand_kernel``: each request's value over its tokens (``cu_num_tokens``: cumulative counts), with
    ``replace_from`` replaced by ``replace_to``, written into ``output`` in its own dtype."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def fix_cpu_expand() -> None:
    """Have vLLM's CPU platform register :func:`expand` for the rejection sampler's ``expand_kernel`` (it registers
    its stand-ins when the worker starts, after the plugins load). Idempotent."""
    compat.replace("cpu_expand_kernel", expand)


def fix_empty_drafts() -> None:
    """Have vLLM's rejection sampler return an empty batch of drafted positions' logits as it is, instead of
    constraining it (nothing to constrain; vLLM's CPU top-k path fails on it). Idempotent."""
    constrain = compat.original("sampling_constraints")
    if getattr(constrain, "skips_empty", False):
        return

    def apply_sampling_constraints(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return logits if logits.shape[0] == 0 else constrain(logits, *args, **kwargs)

    apply_sampling_constraints.skips_empty = True
    compat.replace("sampling_constraints", apply_sampling_constraints)
