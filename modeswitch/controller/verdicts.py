"""Why a mode cannot take a request: a typed verdict (a code plus the human detail).

Gates answer with a :class:`Verdict` instead of a sentence so that what a refusal means (and whether
waiting would help) never depends on how the sentence is worded: the API maps :class:`Code` to an HTTP
status and Retry-After, and rewording a detail changes only what people read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable


class Code(enum.Enum):
    """Why a mode is filtered for a request (the gate that said no, or the controller itself)."""

    NOT_LOADED = "not_loaded"    # defined, but left out of this server (--modes)
    EXCLUDED = "excluded"        # it failed an earlier attempt of this request
    LOADING = "loading"          # it is still being built, after the server began serving (staged start)
    UNAVAILABLE = "unavailable"  # it could not be built or warmed up
    QUARANTINED = "quarantined"  # it failed a request recently and is backing off
    CAPABILITY = "capability"    # it cannot honour the request (sampling, prompt logprobs)
    SATURATED = "saturated"      # its bounded queue is full
    QUALITY = "quality"          # it fails the quality gate for the request's task family
    GATE_PENDING = "gate_pending"  # its gate rows were scored on other kernels: served only when a request pins it
    MEMORY = "memory"            # memory pressure, and it would allocate KV for the request
    ENERGY = "energy"            # its running J/token is over the cap that applies

    @property
    def transient(self) -> bool:
        """Whether waiting helps: queues drain, quarantines end, memory is freed, loading modes come up."""
        return self in TRANSIENT


TRANSIENT = frozenset({Code.SATURATED, Code.QUARANTINED, Code.MEMORY, Code.LOADING})

#: When every mode is filtered, the code a refusal carries: the most hopeful first (waiting helps, the
#: soonest first), then the most specific to this request, then the ones about the mode alone.
PRECEDENCE = (Code.SATURATED, Code.QUARANTINED, Code.LOADING, Code.MEMORY, Code.CAPABILITY, Code.GATE_PENDING,
              Code.QUALITY, Code.ENERGY, Code.EXCLUDED, Code.UNAVAILABLE, Code.NOT_LOADED)


@dataclass(frozen=True, slots=True)
class Verdict:
    code: Code
    detail: str  # the reason as people read it (responses' ``reason``, /v1/modes, logs)

    def __str__(self) -> str:
        return self.detail


def most_hopeful(codes: Iterable[Code]) -> Code:
    """The code that speaks for a set of refusals, by :data:`PRECEDENCE` (none at all: unavailable)."""
    present = set(codes)
    return next((code for code in PRECEDENCE if code in present), Code.UNAVAILABLE)
