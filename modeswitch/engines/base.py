"""The one engine interface every mode is served through.

An engine worker owns a queue of :class:`GenRequest` and runs the model on its own thread(s); the HTTP
request thread only submits and then reads :class:`Event` objects from the request's own queue. Text,
stop strings and OpenAI formatting live above this layer (``modeswitch.serving.service``), so engines deal in
token ids only and share no formatting code.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple, Protocol

from ..sampling_params import OPTIONS, SamplingParams

if TYPE_CHECKING:
    from ..energy import EnergyAccountant, StepCost


class RestartRecord(Protocol):
    """What an engine reads of its supervisor's record (``backends.restarts.Restarts``: the backends, above the
    engines, keep it)."""

    def stats(self) -> dict[str, Any]: ...


class QueueFull(RuntimeError):
    """The engine's bounded queue is full; the caller should try another mode or answer 503."""


@dataclass(frozen=True)
class Event:
    """One message from an engine to the request that owns it.

    kind ``tokens``: ``token_ids`` were generated (one or more, speculative steps emit several); when the request
    asked for ``logprobs``, ``info["logprobs"]`` has one :class:`TokenLogprobs` per token.
    kind ``done``: generation ended; ``info`` has ``finish_reason`` (``stop`` | ``length`` | ``cancelled``),
    ``cached_tokens`` and any mode-specific statistics.
    kind ``error``: the engine failed this request; ``info["error"]`` says why.
    """

    kind: str
    token_ids: tuple[int, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)


class TokenLogprobs(NamedTuple):
    """A generated token, its logprob and the ``k`` most likely tokens at its position (id -> logprob, most likely
    first: OpenAI's ``top_logprobs``), from the model's distribution under the grammar's mask, before any penalty,
    bias or temperature (vLLM's default, ``raw_logprobs``)."""

    token: int
    logprob: float
    top: dict[int, float]


@dataclass
class GenRequest:
    """A tokenized request handed to an engine, with the channel its events go back on."""

    prompt_ids: list[int]
    params: SamplingParams
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_finish: list[Callable[[], None]] = field(default_factory=list)
    finished: bool = False
    #: set once the ``on_finish`` hooks have run (the engine's slot is free again: its count of requests in
    #: flight no longer holds this one)
    released: bool = False
    #: energy attributed to this request's share of the engine steps it took part in (see modeswitch.energy)
    energy_j: float = 0.0
    #: what :meth:`after_release` was given before the request was released, and the lock that keeps a hook
    #: given just as it is released from being missed
    _after_release: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False, compare=False)
    _release_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def emit(self, kind: str, token_ids=(), **info) -> None:
        """Send an event to the request's reader; the first terminal event also runs ``on_finish`` hooks."""
        if self.finished:
            return
        if kind in ("done", "error"):
            self.finished = True
            for hook in self.on_finish:
                hook()
            with self._release_lock:
                self.released = True
            for hook in self._after_release:
                hook()
        self.events.put(Event(kind, tuple(token_ids), info))

    def after_release(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the request is :attr:`released` (from the engine's thread), or now if it is."""
        with self._release_lock:
            if not self.released:
                self._after_release.append(hook)
                return
        hook()

    def cancel(self) -> None:
        self.cancelled.set()


def spec_tokens_per_step(counters: dict[str, int]) -> dict[str, float]:
    """Tokens a speculative engine produced per target step (both engines report it the same way);
    empty until it has taken a speculative step."""
    steps = counters.get("spec_steps")
    return {"spec_tokens_per_step": round(counters["spec_tokens"] / steps, 3)} if steps else {}


class KvUse(NamedTuple):
    """How full one KV pool reserved at start is, in tokens.

    ``pool`` is the pool's owner, compared by identity: modes whose fronts share one engine (vLLM) return the
    same owner, so whoever sums pools counts it once.
    """

    pool: object
    held: int
    capacity: int


def stalled(since: float | None, bound_s: float) -> str | None:
    """Why an engine counts as wedged, or None: the step under way began at ``since`` (``time.monotonic()``;
    None: no step under way) and has run longer than ``bound_s`` (``--engine-stall-s``; 0: never). Every
    backend's supervisor asks it of its engines, twice a second."""
    if bound_s > 0 and since is not None and (elapsed := time.monotonic() - since) > bound_s:
        return f"one step has run {elapsed:.0f} s (more than --engine-stall-s {bound_s:g})"
    return None


def paged_tokens(lengths: Iterable[int], block: int) -> int:
    """Tokens of KV that sequences of ``lengths`` tokens hold in a paged cache: each rounded up to whole blocks."""
    return sum(-(-n // block) * block for n in lengths)


class Engine(ABC):
    """One mode's worker: a bounded queue in front of a model that generates token ids.

    Implementations call :meth:`GenRequest.emit` from their worker thread and never raise into the
    request thread: a failure of one request becomes an ``error`` event for that request alone.
    """

    #: the request options (:data:`OPTIONS`) it honours; the controller keeps requests that need others away
    capabilities: frozenset[str] = OPTIONS
    #: True when a request allocates no new memory (its KV lives in a pool or static cache reserved at start):
    #: the memory gate keeps such modes open under memory pressure.
    preallocated_kv = False
    #: requests generated at once (1: transformers' ``generate()``, one request at a time; a batching engine's
    #: bound on its batch); the rest of ``in_flight`` waits in the engine's queue. Engines that batch by their
    #: own scheduler also override :meth:`running_now`, their requests in the batch now.
    batch_slots = 1
    #: its supervisor's record of the engine's deaths, restarts and next start (set by the backend that watches it;
    #: modes on one vLLM engine share it): :meth:`supervision` reads it for ``/v1/modes`` and ``/metrics``
    restarts: RestartRecord | None = None

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._in_flight = 0
        #: request-seconds in flight up to ``_counted_at`` (``time.monotonic()``): see :meth:`load_seconds`
        self._load_s = 0.0
        self._counted_at = time.monotonic()
        self._lock = threading.Lock()
        self.energy: EnergyAccountant | None = None
        self.cost: StepCost | None = None
        self._watchers: list[Callable[[str | None, bool], None]] = []

    def watch(self, watcher: Callable[[str | None, bool], None]) -> None:
        """Have ``watcher(down, restarting)`` called when the engine goes down (``down`` says why; ``restarting``:
        it is being started again) and when it is back up (``down`` None). Their backends' supervisors report it
        for vLLM's engines and the transformers engines."""
        self._watchers.append(watcher)

    def supervision(self) -> dict[str, Any]:
        """Its engine's deaths, restarts, parks and seconds to the next start (empty where nothing supervises it):
        part of every supervised engine's :meth:`stats`."""
        return {} if self.restarts is None else self.restarts.stats()

    def report_health(self, down: str | None, restarting: bool = False) -> None:
        for watcher in self._watchers:
            watcher(down, restarting)

    def attach_energy(self, accountant: "EnergyAccountant", cost: "StepCost") -> None:
        """Have every step of this engine metered and split over its requests by ``cost``."""
        self.energy, self.cost = accountant, cost

    def _begin_step(self, work: Iterable[tuple[GenRequest, int, int]]) -> int | None:
        """A forward step starts; ``work`` is (request, new tokens, KV tokens after the step) per request.
        Returns the token :meth:`_end_step` takes (None when energy is not metered)."""
        return None if self.energy is None else self.energy.begin_work(self.cost, work)

    def _end_step(self, token: int | None) -> None:
        if token is not None:
            self.energy.end(token)

    @contextmanager
    def _metered_step(self, work: Iterable[tuple[GenRequest, int, int]]) -> Iterator[None]:
        token = self._begin_step(work)
        try:
            yield
        finally:
            self._end_step(token)

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished (waiting or running): the mode's queue depth feature."""
        return self._in_flight

    def load_seconds(self) -> tuple[float, float]:
        """``(time.monotonic(), request-seconds in flight so far)``: the integral of :attr:`in_flight` over time,
        so that the mean number of requests a finished one met here is the difference of two readings over the
        time between them (what the cost model files its step time under, whatever joined or left meanwhile)."""
        with self._lock:
            now = time.monotonic()
            return now, self._load_s + self._in_flight * (now - self._counted_at)

    def _move_in_flight(self, change: int) -> None:
        """``in_flight`` moves by ``change``, the time at the old count added to :meth:`load_seconds` (under the
        lock)."""
        now = time.monotonic()
        self._load_s += self._in_flight * (now - self._counted_at)
        self._counted_at = now
        self._in_flight += change

    def waiting_running(self) -> tuple[int, int]:
        """This mode's in-flight requests split into (waiting, running): queued, or in a batch being generated
        (prefill included), as vLLM's ``num_requests_waiting`` / ``num_requests_running`` count them. Read on
        every metrics scrape, from another thread: it must stay cheap (no engine calls, no waiting on a step)."""
        in_flight = self.in_flight
        running = min(in_flight, self.running_now())
        return in_flight - running, running

    def running_now(self) -> int:
        """How many of this mode's requests are in a batch being generated (at most ``in_flight`` counts)."""
        return self.batch_slots

    def kv_use(self) -> KvUse | None:
        """How full the KV pool this mode's requests are served from is; None for an engine without a bounded
        pool that admissions wait on (transformers' ``generate()`` holds the KV of its one running request only)."""
        return None

    def submit(self, req: GenRequest) -> None:
        """Accept ``req`` or raise :class:`QueueFull`; never blocks on generation."""
        with self._lock:
            if self._in_flight >= self.max_queue:
                raise QueueFull(f"{self._in_flight} requests in flight, limit {self.max_queue}")
            self._move_in_flight(1)
        req.on_finish.append(self._release)
        try:
            self._enqueue(req)
        except Exception as exc:
            req.emit("error", error=f"could not enqueue: {exc}")
            raise

    def _release(self) -> None:
        with self._lock:
            self._move_in_flight(-1)

    @abstractmethod
    def _enqueue(self, req: GenRequest) -> None:
        """Hand an accepted request to the worker."""

    def prefix_match(self, prompt_ids: list[int]) -> int | None:
        """Leading tokens of ``prompt_ids`` whose KV this mode would reuse now (the controller's prefix-match
        feature); None for a mode that reads no prefix cache. Called on the request thread: microseconds."""
        return None

    def stats(self) -> dict[str, Any]:
        """Mode-specific counters for ``/v1/modes`` (prefix hits, speculative acceptance, ...)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop the worker threads; pending requests get an ``error`` event."""
