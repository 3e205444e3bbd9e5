"""What a request would cost on each mode, from what each engine measured on the machine it runs on.

Every engine keeps two curves per *stream* (its plain requests, and apart from them its drafting requests):

- ``prefill``: seconds to the first token against the prompt tokens computed before it, for a request that found
  its engine idle or prompts queued on its lane: its own (the prompt less what the mode's prefix cache holds) and
  those of the requests on the lane still waiting for their first token (a burst's prompts are computed one after
  another, and the last one waits for them all); for a finished request on an engine that counts them
  (``Completed.prefilled_tokens``), those its engine computed until its first token, the prompts that arrived
  after it and joined its step included;
- ``join``: what a first token took over that, against the requests running on the engine when it arrived (within
  its batch) with no prompt queued on the lane (behind queued prompts, it waits for them: the prefill curve's): a
  prompt that finds its engine decoding waits for the step in flight (on vLLM for the one scheduled after it
  too), and its own step carries the others' decodes. One curve for both would price a prompt on an idle
  engine at a busy one's (on the AVX2 EPYC's int8 engine, such a curve predicted 0.126 s for a 40-token prompt that
  took 0.097 s on an idle engine; with one request running, prompts took 0.05-0.08 s more than it predicted);
- ``step``: seconds per target step against the requests running on the engine, this request included (for a
  finished request, their mean number from its first token to its end: ``Completed.loads_met``, its time less
  the prompts its engine computed meanwhile at the prefill curve's slope: they are charged to the requests that
  brought them, as ``delay``), measured while no other engine computes on its *lane* (the cores or device it
  computes on; lanes overlap where they share a core, and an engine pinned nowhere shares every core).

Both are measured where the server runs: by the engine's calibration at start (``serving.calibrate``: a few
pinned requests per stream, behind the first requests) and then by every finished request, in log2 buckets of
the size, each a decaying mean of (size, seconds) so that a bucket follows a machine whose speed changes (:mod:`.curves`).
A curve is read by linear interpolation between the buckets it has measured (on the last two buckets' slope after
the last, and on the first's slope to a bucket of twice its size before the first: :meth:`.Curve.at`): nothing in a
prediction is a constant that this machine did not measure.

A request ``r`` on mode ``m`` of engine ``e`` running ``n`` requests, on a lane running ``b`` requests (``e``'s
and other engines'), ``q`` prompt tokens of them not computed yet, is predicted to take

    own(r, m)   = wait_e + prefill_e(q + unmatched prompt) + join_e(n) + steps(r) x (step_e(1 + o_e) + beside_e)
    delay(r, m) = b x (prefill_e(q + unmatched) - prefill_e(q)) + o x steps(r) x (step_e(n + 1) - step_e(n))

where ``o_e`` counts the requests running on ``e`` by the share of ``r``'s tokens each may still generate beside
it (min(its tokens left, r's max_tokens) / r's max_tokens: ``Features.decode_overlap_by_mode``), so that
``1 + o_e`` (read to a quarter of a request) is the mean load ``r``'s steps meet from them, as the step curve is
measured, and a burst's requests near their end count little; ``o`` is the same over the lane (each of them is
slowed only while it runs beside ``r``);
``steps(r)`` is ``(max_tokens - 1) / tokens_per_step(m, r)``: ``tokens_per_step`` is 1 for a plain mode
and, for a speculative one, 1 plus the drafting gain learned for this kind of request (:mod:`.speculation`, which
replays drafting at its full bound) times the share of that gain the engine's drafting requests got at load
``1 + o_e`` (a third curve, ``draft_yield``, from every finished drafting request: an engine that drafts less when
busy, as the vLLM engines' drafting budget does on a CPU, delivers less of it there; all of it until measured);
a drafting stream's ``step_e`` is moved by the tokens the request is predicted to draft a step (each one verified,
accepted or not: on a CPU a step that verifies five drafts costs more than one that verifies none) along a line
fitted per load bucket to its finished requests' steps, over the curve at their load, against their predicted
drafts (``verify``, :class:`~.curves.DraftFit`; the curve as it is until a bucket has its slope);
``join_e(n)`` is 0 where ``n`` is 0 or ``q`` is not (and never below 0: a busy engine does not compute a prompt
sooner than an idle one);
``beside_e`` is one step of each other busy engine on the lane (engines sharing cores take turns);
``wait_e`` counts the requests queued beyond the engine's batch; and ``delay`` is what ``r`` costs the requests
already on the lane (its prompt's share of the prefill they wait behind or stall for, and the growth of every
step they share with it; ``step_e(0)`` is 0, and ``prefill_e(0)`` is ``step_e(n)`` where ``e`` is busy: its
requests would take that step all the same, so a prompt stalls them by its marginal time whether prompts are queued
ahead of it or not; 0 where ``e`` is idle). A mode whose stream has not measured a
curve yet predicts nothing (``None``): it is never compared on a guess, so one mode's unmeasured prior cannot
mask another's measured cost.

Each stream also counts the finished requests it served by kind of request (``served``: task, prompt length,
repetition, as :class:`~.features.Kind`), which a policy that explores reads (``predict.explore``, :mod:`.rules`).

The measurements are kept per engine *key* (machine, model, engine configuration: what makes the costs
valid) in a JSON file, so a restart on the same machine starts with what the last run measured.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Protocol

from ..files import replace_whole
from .completed import Completed
from .curves import Curve, StreamCosts
from .features import Features
from .speculation import tokens_per_step as tokens_per_target_step

log = logging.getLogger(__name__)

#: seconds an engine idle by measurement keeps the curves it was judged on before the calibration measures it again
#: (at a moment its lane is quiet): no request of its own corrects them, so a measurement disturbed at start, or a
#: machine that changed since, would otherwise park it for good
REMEASURE_IDLE_S = 600.0
#: the least drafting gain (tokens per target step less one) a prediction must promise for the share of it a
#: request got to be learned (a ratio to nearly nothing says nothing), and the most that share is counted at
MIN_PREDICTED_GAIN = 0.1
MAX_YIELD = 2.0
#: the engine loads (requests in one batch) the calibration measures a step at, and over which the weights kinds'
#: steps are compared before the engines start (:meth:`CostModel.step_by_weights`)
CALIBRATED_LOADS = (1, 2, 4, 8, 16)
#: a lane's state in a prediction (requests, prompt tokens queued, other engines' turns, requests met) with nothing
#: in flight on it or near it
_IDLE_LANE = (0, 0, 0.0, 0.0)


class Prediction(NamedTuple):
    """A mode's predicted seconds for one request: its own time to the last token, and the delay it adds to
    the requests already on the lane; ``total`` is what a policy minimises. (A tuple: a decision builds one
    per mode it compares.)"""

    own_s: float
    delay_s: float
    wait_s: float
    prefill_s: float
    decode_s: float

    @property
    def total(self) -> float:
        return self.own_s + self.delay_s

    def as_dict(self) -> dict[str, float]:
        return {"total_s": self.own_s + self.delay_s, "own_s": self.own_s, "delay_s": self.delay_s,
                "wait_s": self.wait_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


class Measured(NamedTuple):
    """A weights kind's mean step over :data:`CALIBRATED_LOADS` as an earlier run here measured it, and its engine's
    kernels card then (None where the engine did not describe its kernels)."""

    step_s: float
    kernels: Mapping[str, Any] | None


class Predict(Protocol):
    """One request's predictions (:meth:`CostModel.predictor`): a mode's, or None while its stream has not measured
    both curves. ``idle``: the modes whose engine is idle by measurement (``CostModel._idle_engines``), which a
    policy ordering by prediction compares only when no other mode has a prediction, so it need not predict them
    otherwise (a plain function is a ``Predict`` with none). ``explore``: :meth:`CostModel.predictor`'s (a plain
    function has none: nothing is explored)."""

    idle: frozenset[str]

    def __call__(self, mode: str) -> Prediction | None: ...

    def explore(self, mode: str, than: str, under: int) -> tuple[int, str] | None: ...


@dataclass(frozen=True)
class Binding:
    """How the resident modes map onto measured costs (``CostModel.bind``)."""

    #: mode -> its stream (its engine's name; a drafting mode's requests apart: "<engine> drafting")
    streams: Mapping[str, str]
    #: mode -> the lane its engine computes on: its CPUs ("0,1"), or "" where it is not pinned (every CPU; a GPU's
    #: engines all share the device). Engines on lanes that overlap share their compute.
    lanes: Mapping[str, str]
    #: mode -> its engine (modes on one engine share its batch and queue)
    engines: Mapping[str, str]
    #: mode -> requests its engine generates at once
    slots: Mapping[str, int]
    #: the speculative modes
    drafting: frozenset[str] = frozenset()
    #: stream -> the key its measurements are valid for (machine, model, engine configuration)
    keys: Mapping[str, str] | None = None
    #: speculative mode -> the plain mode on the same weights it would otherwise be (speculation_gain)
    pairs: Mapping[str, str] | None = None
    #: mode -> the weights it computes with (engines on other weights may make its engine idle by measurement)
    weights: Mapping[str, str] | None = None


class CostModel:
    """Per engine stream, measured prefill and step curves; :meth:`predict` is what a decision reads, and
    :meth:`observe` (an observer of the controller) corrects the curves from every finished request."""

    def __init__(self, path: str | Path | None = None) -> None:
        """``path``: the JSON file the measurements are kept in across restarts (None: not kept)."""
        self.path = Path(path) if path is not None else None
        self.binding = Binding({}, {}, {}, {})
        self._streams: dict[str, StreamCosts] = {}
        self._idle: frozenset[str] = frozenset()  # the engines idle by measurement, as of the last change
        self._idle_modes: frozenset[str] = frozenset()  # the modes on them
        self._derive(self.binding)
        self._keys: dict[str, str] = {}  # stream -> the key its curves are kept under
        self._stale: set[str] = set()  # streams whose engine changed since their curves were measured
        #: when each stream's curves were last measured whole (a calibration, or read from the file at bind)
        self._measured_at: dict[str, float] = {}
        self.remeasure_idle_s = REMEASURE_IDLE_S
        #: what the engines' calibration is doing (``serving.calibrate``), as ``/v1/modes`` shows it
        self.calibration = "off"
        self._saved: dict[str, Any] = self._read()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ binding and persistence
    def bind(self, binding: Binding) -> None:
        """The resident modes as they stand now. A stream keeps its curves while its key is the same. A stream
        whose key changed (its engine now compiled, say) takes what was measured under the new key (this run or
        an earlier one); with nothing there it keeps its curves, marked stale, until it is measured again
        (:meth:`needs_measuring`): an engine that changed is still better predicted by its old figures than not
        at all. Curves left behind are kept under their old key."""
        with self._lock:
            self.binding = binding
            self._derive(binding)
            keys = binding.keys or {}
            for stream in set(binding.streams.values()):
                key = keys.get(stream, "")
                if stream in self._streams and self._keys.get(stream) == key:
                    continue
                old = self._streams.get(stream)
                if old is not None and old.measured and self._keys.get(stream):
                    self._saved[self._keys[stream]] = old.dump()
                saved = self._saved.get(key) if key else None
                try:
                    fresh = StreamCosts.load(saved) if saved else None
                except (KeyError, TypeError, ValueError):
                    log.warning("ignoring the saved costs of %s: not in the expected shape", stream)
                    fresh = None
                if fresh is None and old is not None and old.measured:
                    self._stale.add(stream)
                else:
                    self._streams[stream] = fresh or StreamCosts.empty()
                    self._stale.discard(stream)
                    self._measured_at[stream] = time.monotonic()
                self._keys[stream] = key
            self._find_idle()

    def _derive(self, binding: Binding) -> None:
        """What a prediction reads of the binding, worked out once: per lane the lanes overlapping it (itself
        included), and per engine its lane and the stream whose step curve is its own (a plain one where it has
        one)."""
        cpus = {lane: set(lane.split(",")) if lane else None for lane in set(binding.lanes.values()) | {""}}
        self._near = {lane: tuple(o for o, c in cpus.items() if mine is None or c is None or mine & c)
                      for lane, mine in cpus.items()}
        self._engine_lane, self._engine_stream = {}, {}
        #: mode -> (its lane, its engine): where a request in flight on it counts
        self._places = {mode: (binding.lanes.get(mode, ""), engine) for mode, engine in binding.engines.items()}
        #: mode -> (stream, lane, engine, slots, drafting): what predicting it reads, in one lookup
        self._modes = {mode: (stream, binding.lanes.get(mode, ""), binding.engines.get(mode, mode),
                              binding.slots.get(mode, 1) or 1, mode in binding.drafting)
                       for mode, stream in binding.streams.items()}
        #: engine -> (its weights, whether its own stream (``_engine_stream``) drafts), for ``_idle_engines``
        self._compared: dict[str, tuple[str, bool]] = {}
        for mode, engine in binding.engines.items():
            self._engine_lane[engine] = binding.lanes.get(mode, "")
            if engine not in self._engine_stream or mode not in binding.drafting:
                self._engine_stream[engine] = binding.streams.get(mode, engine)
                if mode in binding.streams:
                    self._compared[engine] = ((binding.weights or {}).get(mode, ""), mode in binding.drafting)

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            log.warning("ignoring %s: not a readable cost file", self.path)
            return {}

    def save(self) -> None:
        """Write every keyed stream's curves (merged into what the file holds for other keys)."""
        if self.path is None:
            return
        with self._lock:
            for stream, key in self._keys.items():
                costs = self._streams.get(stream)
                if key and costs is not None and costs.measured:
                    self._saved[key] = costs.dump()
            data = dict(self._saved)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_whole(self.path, json.dumps(data, indent=1, sort_keys=True))
        except OSError as exc:
            log.warning("could not save the measured costs to %s: %s", self.path, exc)

    # ------------------------------------------------------------------ measuring
    def stream(self, name: str) -> StreamCosts:
        with self._lock:
            return self._streams.setdefault(name, StreamCosts.empty())

    def measured(self, stream: str) -> bool:
        costs = self._streams.get(stream)
        return costs is not None and costs.measured

    def needs_measuring(self, stream: str) -> str | None:
        """Why ``stream`` should be calibrated ("unmeasured"; "stale": its engine changed; "idle": its engine is
        idle by measurement on curves older than :attr:`remeasure_idle_s`), or None."""
        if not self.measured(stream):
            return "unmeasured"
        if stream in self._stale:
            return "stale"
        if (stream in self.idle_by_measurement()
                and time.monotonic() - self._measured_at.get(stream, 0.0) > self.remeasure_idle_s):
            return "idle"
        return None

    def install(self, stream: str, costs: StreamCosts) -> None:
        """Replace ``stream``'s curves with a calibration's, measured whole before they count (what its drafting
        delivered, what a step costs by the drafts and what a prompt waits on a busy engine are learned from live
        requests only: kept)."""
        with self._lock:
            old = self._streams.get(stream)
            if old is not None and not costs.draft_yield.measured:
                costs.draft_yield = old.draft_yield
            if old is not None and not costs.verify.buckets:
                costs.verify = old.verify
            if old is not None and not costs.join.measured:
                costs.join = old.join
            if old is not None and not costs.served:
                costs.served = old.served
            self._streams[stream] = costs
            self._stale.discard(stream)
            self._measured_at[stream] = time.monotonic()
            self._find_idle()

    def add_prefill(self, stream: str, tokens: int, seconds: float, decoding: int = 0) -> None:
        """A first token's seconds after ``tokens`` prompt tokens computed; ``decoding``: the requests its engine ran
        when it arrived with no prompt queued on its lane (0: it found the engine idle, or prompts queued, which it
        waited for: the prefill curve's), else what it took over the prefill curve is ``join``'s (once that curve
        has measured something to take it over)."""
        costs = self.stream(stream)
        tokens = max(tokens, 1)
        with self._lock:
            if not decoding:
                costs.prefill.add(tokens, seconds)
            elif costs.prefill.measured:
                costs.join.add(decoding, seconds - costs.prefill.at(tokens))

    def add_step(self, stream: str, lane_load: float, seconds: float, drafts: float | None = None) -> None:
        """A step's seconds at a load; ``drafts``: the tokens its request was predicted to draft a step (a drafting
        stream's: what the step cost over the curve at its load is fitted against first)."""
        costs = self.stream(stream)
        load = max(lane_load, 1)
        with self._lock:
            if drafts is not None and costs.step.measured:
                costs.verify.add(load, drafts, seconds - costs.step.at(load))
            costs.step.add(load, seconds)
            self._find_idle()

    def add_service(self, stream: str, seconds: float) -> None:
        costs = self.stream(stream)
        with self._lock:
            costs.service.add(0.0, seconds)

    def lane_load(self, mode: str, by_mode: Mapping[str, int]) -> int:
        """The sum of ``by_mode`` (requests in flight, or prompt tokens not computed yet) over the modes whose
        engines compute on a lane overlapping ``mode``'s."""
        lanes = self.binding.lanes
        near = self._near.get(lanes.get(mode, ""), ("",))
        return sum(n for m, n in by_mode.items() if lanes.get(m, "") in near)

    def engine_load(self, mode: str, in_flight_by_mode: Mapping[str, float]) -> tuple[float, float]:
        """Requests in flight on ``mode``'s engine, and on the other engines sharing its lane (counts, or the
        mean counts a request met)."""
        engines, lanes = self.binding.engines, self.binding.lanes
        engine, near = engines.get(mode, mode), self._near.get(lanes.get(mode, ""), ("",))
        own = others = 0
        for m, n in in_flight_by_mode.items():
            if engines.get(m, m) == engine:
                own += n
            elif lanes.get(m, "") in near:
                others += n
        return own, others

    def observe(self, completed: Completed) -> None:
        """Correct the served stream's curves from a finished request: its time to first token against the
        prompt tokens computed before it (its own and those it waited behind), its time per target step against
        the mean requests on its engine it met while it decoded (only where no other engine computed on its lane
        meanwhile: a step shared with another engine's is not this engine's cost), its whole time."""
        b = self.binding
        stream = b.streams.get(completed.mode)
        if (stream is None or completed.outcome != "ok" or completed.retried or completed.scoring
                or completed.ttft_s is None):
            return
        f = completed.features
        self._count(stream, f)
        prefilled = completed.prefilled_tokens
        queued = self.lane_load(completed.mode, f.prefilling_by_mode)  # prompt tokens its lane had still to compute
        if prefilled is None:  # its own prompt and those queued on its lane
            computed = queued + completed.prompt_tokens - f.prefix_match_by_mode.get(completed.mode, 0)
        else:  # what its engine computed until its first token, and what the lane's other engines had still to
            computed = prefilled[0] + self.engine_load(completed.mode, f.prefilling_by_mode)[1]
        # the requests on its engine when it arrived: beyond its batch it waited for a slot (``wait``, predicted from
        # the service time), which says nothing of a prefill; behind prompts queued on its lane, for them (the
        # prefill curve's, at the tokens computed); else, on a busy engine, for the step in flight (``join``)
        running = self.engine_load(completed.mode, f.in_flight_by_mode)[0]
        if running < b.slots.get(completed.mode, 1):
            self.add_prefill(stream, computed, completed.ttft_s, 0 if queued else running)
        self.add_service(stream, completed.latency_s)
        if completed.tpot_s is None or completed.loads_met is None:
            return
        # the mean requests it met on its engine (itself included) while it decoded, not those it found: a request
        # that found its engine idle at the start of a burst spent its steps beside the burst
        own, others = self.engine_load(completed.mode, completed.loads_met)
        seconds = completed.tpot_s
        if prefilled is not None and prefilled[1] > 0:  # less the prompts its steps computed beside its own token
            seconds -= prefilled[1] * (self.stream(stream).prefill.slope() or 0.0) / (completed.completion_tokens - 1)
        drafts = None
        if completed.mode in b.drafting:  # per target step: the tokens per step this request got
            per_step = tokens_per_target_step(completed.completion_tokens, completed.target_steps)
            if per_step is None:
                return
            self._add_yield(stream, own, per_step, f.draft_tokens_per_step)
            seconds *= per_step
            drafts = f.drafts_per_step
        if not others and seconds > 0:  # nothing left of it once the prompts beside it are taken out: not a step
            self.add_step(stream, own, seconds, drafts)

    def _count(self, stream: str, features: Features) -> None:
        """One more request of its kind served by ``stream``."""
        kind = features.kind.name
        costs = self.stream(stream)
        with self._lock:
            costs.served[kind] = costs.served.get(kind, 0) + 1

    def _add_yield(self, stream: str, load: float, got: float, predicted: float) -> None:
        """The share of its predicted drafting gain a drafting request got at ``load`` (tokens per target step less
        one, got over predicted), where the prediction promised a gain to compare with."""
        if predicted - 1.0 < MIN_PREDICTED_GAIN:
            return
        costs = self.stream(stream)
        with self._lock:
            costs.draft_yield.add(load, min(max((got - 1.0) / (predicted - 1.0), 0.0), MAX_YIELD))

    # ------------------------------------------------------------------ predicting
    def predict(self, mode: str, features: Features, tokens_per_step: float = 1.0) -> Prediction | None:
        """``mode``'s predicted time for the request ``features`` describe (see the module's docstring); None
        while its stream has not measured both curves."""
        return self.predictor(features, tokens_per_step)(mode)

    def predictor(self, features: Features, tokens_per_step: float = 1.0) -> Predict:
        """:meth:`predict` for one request: the loads on every lane and engine counted once for all its modes, and
        what a stream's prediction reads of them (its step at the load it would meet, its wait, the prompt tokens
        queued ahead of it) worked out once for all the modes on it, which then differ only in the prompt they
        have left to compute (a decision predicts each mode the gates pass: this keeps it within microseconds)."""
        places, streams, near, modes = self._places, self._streams, self._near, self._modes
        engine_lane, engine_stream = self._engine_lane, self._engine_stream
        on_lane: dict[str, int] = {}
        on_engine: dict[str, int] = {}
        # the same counted by the share of this request's tokens each may still generate beside it: the loads its
        # steps would meet (the requests counted whole where that share is not known)
        met_lane: dict[str, float] = {}
        met_engine: dict[str, float] = {}
        overlap = features.decode_overlap_by_mode
        for m, n in features.in_flight_by_mode.items():
            if n:
                lane, engine = places.get(m) or ("", m)
                x = n if overlap is None else overlap.get(m, 0.0)
                on_lane[lane] = on_lane.get(lane, 0) + n
                on_engine[engine] = on_engine.get(engine, 0) + n
                met_lane[lane] = met_lane.get(lane, 0.0) + x
                met_engine[engine] = met_engine.get(engine, 0.0) + x
        queued: dict[str, int] = {}  # lane -> prompt tokens its requests have not computed yet
        for m, n in features.prefilling_by_mode.items():
            if n:
                lane = places[m][0] if m in places else ""
                queued[lane] = queued.get(lane, 0) + n
        prompt, held, max_tokens = features.prompt_tokens, features.prefix_match_by_mode, features.max_tokens
        drafted = features.drafts_per_step
        busy = bool(on_lane or queued)  # on an idle server every lane's state is _IDLE_LANE: not worked out
        #: engine -> one step of it at its load, on its own curve (its plain stream's; 0 where not measured), and
        #: lane -> the sum of those of its busy engines: read once for every lane and stream that asks
        busy_step: dict[str, float] = {}
        turns: dict[str, float] = {}
        for engine, n in on_engine.items():
            costs = streams.get(engine_stream.get(engine, engine))
            busy_step[engine] = step = (costs.step.at(n) or 0.0) if costs is not None else 0.0
            lane = engine_lane.get(engine, "")
            turns[lane] = turns.get(lane, 0.0) + step
        #: lane -> (requests, prompt tokens not computed, one step of each busy engine, the requests counted by their
        #: share of this request's steps) on the lanes near it
        near_lanes: dict[str, tuple[int, int, float, float]] = {}
        #: stream -> what its modes' predictions share (None: not measured)
        shared: dict[str, tuple | None] = {}
        # modes on one stream with the same prompt left to compute cost the same (fp16 and continuous_batching
        # on one vLLM engine): computed once
        known: dict[tuple[str, int], Prediction | None] = {}

        def lane_state(lane: str) -> tuple[int, int, float, float]:
            state = near_lanes.get(lane)
            if state is None:
                load, ahead, turn, met = 0, 0, 0.0, 0.0
                for x in near.get(lane, ("",)):
                    load += on_lane.get(x, 0)
                    ahead += queued.get(x, 0)
                    met += met_lane.get(x, 0.0)
                    turn += turns.get(x, 0.0)  # engines sharing cores take turns: one step of each other busy one
                state = near_lanes[lane] = (load, ahead, turn if load else 0.0, met)
            return state

        def share(stream: str, lane: str, engine: str, slots: int, drafting: bool) -> tuple | None:
            costs = streams.get(stream)
            if costs is None or not costs.measured:
                return None
            step_at = costs.step.at
            lane_load, ahead, turn, lane_met = lane_state(lane) if busy else _IDLE_LANE
            mine = on_engine.get(engine, 0)
            meets = round(met_engine.get(engine, 0.0) * 4) / 4 + 1  # to a quarter: a curve keeps what it has read
            own_step = step_at(meets)
            if drafting and drafted is not None:
                own_step = costs.verify.step(own_step, meets, drafted)
            # the other busy engines' turns (an engine not measured yet is counted at nothing)
            step = own_step + (turn - busy_step[engine] if mine else turn) if lane_load > mine else own_step
            steps = max_tokens - 1
            if drafting and tokens_per_step > 1:  # the gain predicted, in the share this engine delivers at the load
                delivered = costs.draft_yield.at(meets)
                steps /= 1.0 + (tokens_per_step - 1.0) * (1.0 if delivered is None else delivered)
            waiting = mine + 1 - slots
            wait = -(-waiting // slots) * costs.service.y if waiting > 0 else 0.0
            if mine:
                at_mine = step_at(mine)
                growth = max(step_at(mine + 1) - at_mine, 0.0)
            else:
                at_mine, growth = 0.0, step_at(1)
            # what the lane's requests wait for without it: the prompts queued, or on a busy engine its next step,
            # which they would take all the same
            without = (costs.prefill.at(ahead) if ahead else at_mine) if lane_load else 0.0
            # on an engine decoding, no prompt queued, its prompt waits for the step in flight (never less than on
            # an idle one); behind queued prompts, the prefill curve prices the wait
            joins = max(costs.join.at(mine) or 0.0, 0.0) if 0 < mine < slots and not ahead else 0.0
            return (costs.prefill.at, lane_load, ahead, steps, steps * step, wait, lane_met * steps * growth, without,
                    joins)

        def predict(mode: str) -> Prediction | None:
            place = modes.get(mode) or ("", "", mode, 1, False)
            stream = place[0]
            key = (stream, max(prompt - held.get(mode, 0), 1))
            if key in known:
                return known[key]
            if stream not in shared:
                shared[stream] = share(*place)
            terms = shared[stream]
            if terms is None:
                known[key] = None
                return None
            prefill_at, lane_load, ahead, steps, decode, wait, slowed, without, joins = terms
            prefill = prefill_at(ahead + key[1])
            # its prompt stalls every request on the lane (by its computing, not by its waiting for their step); each
            # of its steps lengthens theirs, while they run
            delay = lane_load * max(prefill - without, 0.0) + slowed if lane_load else 0.0
            prefill += joins
            known[key] = prediction = Prediction(wait + prefill + decode, delay, wait, prefill, decode)
            return prediction

        kind: list[str] = []  # this request's kind, named once where asked

        def explore(mode: str, than: str, under: int) -> tuple[int, str] | None:
            """(the requests of this request's kind ``mode``'s stream has served, the kind) where ``mode`` drafts,
            its stream has served fewer than ``under`` of the kind, is not ``than``'s, and nothing runs or waits on
            its lane or a lane sharing its cores; else None. A drafting stream's cost depends on the kind (what it
            drafts and how much of that is accepted), and its curves predict a kind it never served from those it
            did (one that served prose prices a copying request by its prose steps' drafts and yield), which
            nothing corrects while no request of the kind goes there; on an idle lane one that does delays no one,
            and is measured alone. A plain stream's step is the same whatever the text: nothing to explore."""
            place, other = modes.get(mode), modes.get(than)
            if place is None or not place[4] or (other is not None and other[0] == place[0]):
                return None
            costs = streams.get(place[0])
            if costs is None or (busy and lane_state(place[1])[:2] != (0, 0)):
                return None
            if not kind:
                kind.append(features.kind.name)
            served = costs.served.get(kind[0], 0)
            return (served, kind[0]) if served < under else None

        predict.idle = self._idle_modes  # type: ignore[attr-defined]
        predict.explore = explore  # type: ignore[attr-defined]
        return predict

    def speculation_gain(self, features: Features, tokens_per_step: float) -> float:
        """The best predicted speed-up of a speculative mode over the plain mode on its weights for this
        request (own times, at the loads they would meet), among pairs whose streams are both measured; 0
        when none is."""
        best = 0.0
        drafting, plain_mode = self.predictor(features, tokens_per_step), self.predictor(features)
        for spec, plain in (self.binding.pairs or {}).items():
            drafted, base = drafting(spec), plain_mode(plain)
            if drafted is not None and base is not None and drafted.own_s > 0:
                best = max(best, base.own_s / drafted.own_s)
        return best

    def describe(self) -> dict[str, Any]:
        """What ``/v1/modes`` shows: per stream its curves with the samples behind each point (and a drafting stream's
        seconds a step per predicted draft, by load), the key they are kept under, and which streams no mode on them
        needs because another lane is faster at every load."""
        b = self.binding
        with self._lock:
            out = {stream: {**costs.dump(), "key": (b.keys or {}).get(stream, ""),
                            **({"step_s_per_draft_by_engine_load": costs.verify.slopes()} if costs.verify.buckets
                               else {})}
                   for stream, costs in sorted(self._streams.items()) if stream in set(b.streams.values())}
        for stream in self.idle_by_measurement():
            out[stream]["idle_by_measurement"] = True
        return {"calibration": self.calibration, "streams": out, "modes": dict(b.streams),
                "path": str(self.path) if self.path else None}

    def step_by_weights(self, machine: str, model: str, backend: str, weights: Iterable[str]) -> dict[str, Measured]:
        """Per weights kind, the mean seconds per step over :data:`CALIBRATED_LOADS` on the step curve its plain
        engine measured here (this machine, model and engine family, in this file: a run before this one) with
        the kernels it ran, fastest first; what an engine layout and a staged start's first engine may follow
        before the engines start (``compose``). Over the loads, not at one request: the finished requests move
        a bucket's mean load (1.7 requests in the first, say), below which a curve is extended, not measured, so
        one request's step alone would compare an estimate for one engine with another's measurement.
        ``backend`` is the engine family serving them, alone or beside a fallback (``vllm`` matches
        ``vllm+transformers``); a stream the fallback's engine measured (its kernels card names that engine: GPTQ
        on transformers on an AVX2 CPU) is not one of the family's, whose layout this orders."""
        kinds, out = set(weights), {}
        for key, data in self._saved.items():
            try:
                version, mach, mod, back, stream, extra = json.loads(key)
                curve = Curve.load(data["step_s_by_engine_load"])
                step = sum(curve.at(x) for x in CALIBRATED_LOADS) / len(CALIBRATED_LOADS) if curve.measured else 0
                kernels = extra.get("kernels") or {}
                engine = kernels.get("engine", backend).split(":")[0]
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            if (version, mach, mod, back.split("+")[0], engine) == (CURVES_VERSION, machine, model, backend, backend) \
                    and stream in kinds and step and (stream not in out or step < out[stream].step_s):
                out[stream] = Measured(step, kernels or None)
        return dict(sorted(out.items(), key=lambda kv: kv[1].step_s))

    def idle_by_measurement(self) -> list[str]:
        """The streams the engines idle by measurement were compared on (:meth:`_idle_engines`): each one's plain
        stream, a drafting-only engine's drafting one."""
        return sorted(self._engine_stream[e] for e in self._idle if e in self._engine_stream)

    def _find_idle(self) -> None:
        """Work out the engines idle by measurement and the modes on them (when a curve or the binding changes)."""
        self._idle = self._idle_engines()
        self._idle_modes = frozenset(m for m, (_, _, engine, _, _) in self._modes.items() if engine in self._idle)

    def _idle_engines(self) -> frozenset[str]:
        """The engines whose plain stream is slower, at every load it has measured, than the plain stream of an
        engine on other weights computing on an overlapping lane, measured at each of those loads too; an engine
        that serves drafting modes only, likewise against the drafting-only engines. Such an engine's steps take
        turns with a faster one's on the same cores: any request it takes is served slower and slows the faster
        engine's, so the measurements give it no work that pays (a gate or a pinned request still may). Engines on
        the same weights are not compared: what tells them apart is what a request finds there (a cached prefix,
        drafting), which its prediction already weighs. Worked out when a curve or the binding changes, not per
        decision."""
        #: engine -> its measured step curve, lane, weights, whether it drafts
        compared: dict[str, tuple[Curve, str, str, bool]] = {}
        for engine, (kind, drafts) in self._compared.items():
            costs = self._streams.get(self._engine_stream[engine])
            if costs is not None and costs.step.measured:
                compared[engine] = (costs.step, self._engine_lane.get(engine, ""), kind, drafts)
        idle = set()
        for engine, (curve, lane, kind, drafts) in compared.items():
            loads = [x for x, _, _ in curve.dump()]
            for other, (faster, other_lane, other_kind, other_drafts) in compared.items():
                if (other_kind != kind and other_drafts == drafts and other_lane in self._near.get(lane, ("",))
                        and all(faster.samples(x) and faster.at(x) < curve.at(x) for x in loads)):
                    idle.add(engine)
                    break
        return frozenset(idle)


#: what the curves mean (their sizes and seconds): a saved measurement of another version is not read
CURVES_VERSION = 7


def stream_key(machine: str, model: str, backend: str, stream: str, details: Mapping[str, Any]) -> str:
    """The key a stream's measurements are kept under: the curves' version, the machine, the model, the engine
    family, the stream, and what its mode's card says of the engine (kernels, eager or compiled, the cores it is
    pinned to, whether it drafts for any of its modes). Measurements taken under another key are never read for it."""
    engine = {k: details[k] for k in ("kernels", "decode", "draft", "engine_drafts") if k in details}
    engine["cpus"] = len(details.get("cpus", ()))
    return json.dumps([CURVES_VERSION, machine, model, backend, stream, engine], sort_keys=True)
