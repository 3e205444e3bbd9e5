"""A finished request as the controller's observers see it: one record, built once, for every observer.

The service builds a :class:`Completed` when a request ends, however it ends, and hands it to
``Controller.observe``; each observer (a learning policy, the metrics) decides for itself which records
it uses, so the service holds no per-observer rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from .features import Features


@dataclass(frozen=True, slots=True)
class Completed:
    mode: str                    # the mode that served (or last failed) the request
    features: Features           # what the controller knew when it decided
    outcome: Literal["ok", "error", "cancelled"]  # cancelled: the client went away
    ttft_s: float | None         # time to first token (None: no token came)
    tpot_s: float | None         # time per output token after the first (None: fewer than two tokens)
    latency_s: float             # start to end, all attempts
    prompt_tokens: int
    completion_tokens: int
    energy_j: float              # energy attributed to the request, all attempts
    energy_source: str           # "measured" or "estimated" (never summed together)
    retried: bool                # another mode refused or failed it first: timings span modes
    scoring: bool                # prompt logprobs were asked for (costs differ from generation)
    prompt_ids: tuple[int, ...] = ()   # the prompt, and the tokens generated (what drafting would have seen)
    output_ids: tuple[int, ...] = ()
    target_steps: int | None = None    # a speculative mode's target steps (None: not speculative)
    #: per mode with requests in flight meanwhile, the mean number of them from its first token to its end (its own
    #: included): the loads its time per token was spent at (None: fewer than two tokens, or not known)
    loads_met: Mapping[str, float] | None = None
    #: the prompt tokens its engine computed from its submission to its first token (its own, those ahead of it and
    #: those computed in the step with it), and while it decoded (None: its engine does not count them)
    prefilled_tokens: tuple[int, int] | None = None


#: Something that wants every completed request (``Controller.add_observer``).
Observer = Callable[[Completed], None]
