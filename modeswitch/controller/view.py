"""What the controller reads of a resident mode: a read-only view, whatever keeps the state.

The registry of resident modes owns health, quarantine and energy figures and knows its engines; the
controller only reads these attributes, so it neither imports the registry nor branches on an engine's
kind, and a test can decide over plain objects.
"""

from __future__ import annotations

from typing import Protocol


class ModeView(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def batch(self) -> str:
        """The running batch it shares with other modes (its engine's name), or its own name."""

    @property
    def available(self) -> bool:
        """Built and warmed up."""

    @property
    def loading(self) -> bool:
        """Still being built after the server began serving (a staged start): available soon."""

    @property
    def reason(self) -> str:
        """Why it is unavailable (empty when available)."""

    @property
    def max_queue(self) -> int:
        """The bound on its requests queued or running (``Features.in_flight_by_mode``): at it the mode is
        saturated."""

    @property
    def batch_slots(self) -> int:
        """Requests its engine generates at once (1: one at a time)."""

    @property
    def speculative(self) -> bool:
        """It drafts tokens and verifies them (speculative decoding): its time per token depends on acceptance."""

    @property
    def capabilities(self) -> frozenset[str]:
        """The request options it honours (``modeswitch.engines.base.OPTIONS`` names: temperature, logprobs,
        structured_outputs, prompt_logprobs, ...)."""

    @property
    def preallocated_kv(self) -> bool:
        """Its KV is reserved at start, so a request allocates none (what memory pressure allows)."""

    @property
    def quarantined_until(self) -> float:
        """When its quarantine after a failure ends (``time.monotonic()``; 0 when healthy): a gate reads the clock
        once for every mode."""

    @property
    def last_error(self) -> str:
        """The failure that quarantined it."""

    @property
    def kernels(self) -> dict | None:
        """What its linears run here (its ``/v1/modes`` card's ``kernels``; None where its engine cannot say, or
        before it is built): the quality gate judges it by a row scored on these."""

    @property
    def j_per_token(self) -> float | None:
        """Running J per generated token over its completed requests (None before the first)."""

    @property
    def watts(self) -> float | None:
        """Running watts its completed requests drew while they ran (None before the first)."""
