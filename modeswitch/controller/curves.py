"""Measured curves: seconds against a size, in log2 buckets, each bucket a decaying mean of what was measured in
it, read by linear interpolation between the buckets measured; and the curves (plus the whole-request time) an
engine stream keeps. What :mod:`.costs` predicts from; apart from it because they know nothing of modes, engines
or lanes."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

#: weight of each new observation in a bucket's running means once it has this many (1 / WEIGHT) samples:
#: about the last twenty of a bucket count, so a bucket follows a changing machine within a burst
WEIGHT = 0.05


def bucket(size: float) -> int:
    """The log2 bucket of a size (1, 2-3, 4-7, ...): costs grow with size, rarely linearly."""
    return max(int(size), 1).bit_length()


class _Point:
    """One bucket's running means of (size, seconds), weighing recent samples more once it has many."""

    __slots__ = ("x", "y", "n")

    def __init__(self, x: float = 0.0, y: float = 0.0, n: int = 0) -> None:
        self.x, self.y, self.n = x, y, n

    def add(self, x: float, y: float) -> None:
        self.n += 1
        w = max(WEIGHT, 1.0 / self.n)
        self.x += (x - self.x) * w
        self.y += (y - self.y) * w


#: values a curve keeps read (prompt lengths vary widely; loads repeat): past this it starts over
MAX_READS = 1024


class Curve:
    """Seconds against a size, in log2 buckets; :meth:`at` interpolates between the measured ones. ``signed``: its
    samples are differences (seconds over another curve's) and keep their sign: noise below that curve is averaged
    in, not dropped, so the mean is not biased up."""

    def __init__(self, signed: bool = False) -> None:
        self.signed = signed
        self._points: dict[int, _Point] = {}
        #: the measured buckets' mean sizes, ascending, their mean seconds, and the values read from them so far:
        #: one tuple, replaced whole, so a reader on another thread never sees the sizes of one update with the
        #: seconds (or the values read) of another
        self._xy: tuple[list[float], list[float], dict[float, float]] = ([], [], {})

    def add(self, size: float, seconds: float) -> None:
        if not math.isfinite(seconds) or (seconds < 0 and not self.signed):
            return
        self._points.setdefault(bucket(size), _Point()).add(float(size), float(seconds))
        self._index()

    def _index(self) -> None:
        points = [p for _, p in sorted(self._points.items())]
        self._xy = ([p.x for p in points], [p.y for p in points], {})

    @property
    def measured(self) -> bool:
        return bool(self._xy[0])

    def at(self, size: float) -> float | None:
        """The seconds at ``size``: interpolated between the measured buckets around it, extended on the slope of the
        last two above the last and below the first on its slope to the first bucket of at least twice its size
        (:meth:`_below`); flat with one; None when nothing is measured.
        A decision reads the same few sizes (loads, prompt lengths) of a curve again and again until the next
        sample changes it: each is interpolated once."""
        xs, ys, read = self._xy
        value = read.get(size)
        if value is None and xs:
            if len(read) >= MAX_READS:
                read.clear()
            value = read[size] = self._interpolate(xs, ys, size)
        return value

    @staticmethod
    def _interpolate(xs: list[float], ys: list[float], size: float) -> float:
        i = bisect.bisect_left(xs, size)
        if i == 0:
            return ys[0] if size >= xs[0] else Curve._below(xs, ys, size)
        if i == len(xs):
            if i == 1:
                return ys[0]
            i -= 1  # beyond the last: the last segment's slope, never falling
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 0.0
            return ys[i] + max(slope, 0.0) * (size - xs[i])
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (size - x0) / (x1 - x0) if x1 > x0 else ys[i]

    @staticmethod
    def _below(xs: list[float], ys: list[float], size: float) -> float:
        """Below the first bucket: its mean size is that of what it measured (a step bucket spans 1-1.99 requests, and
        one that mostly measured requests beside others means 1.4 or more), so a lone request read there flat would
        be priced at the load of others. Extended down on the slope to the first bucket of at least twice its size
        (two buckets' means may lie close, and their noise then makes a steep slope), never rising, and never below
        the first bucket's seconds scaled down in proportion to size (no cost with a fixed part of zero or more
        is); flat where no bucket is that far."""
        j = bisect.bisect_left(xs, 2 * xs[0])
        if j == len(xs) or xs[0] <= 0:
            return ys[0]
        slope = max((ys[j] - ys[0]) / (xs[j] - xs[0]), 0.0)
        return max(ys[0] - slope * (xs[0] - size), ys[0] * max(size, 0.0) / xs[0])

    def slope(self) -> float | None:
        """Seconds per unit of size from its first measured bucket to its last (what one more token of a prompt
        costs, on a prefill curve; never below 0); None with fewer than two buckets."""
        xs, ys, _ = self._xy
        if len(xs) < 2 or xs[-1] <= xs[0]:
            return None
        return max((ys[-1] - ys[0]) / (xs[-1] - xs[0]), 0.0)

    def samples(self, size: float) -> int:
        point = self._points.get(bucket(size))
        return point.n if point is not None else 0

    def dump(self) -> list[list[float]]:
        """Its buckets as ``[size, seconds, samples]`` (what ``/v1/modes`` shows and the cache keeps)."""
        return [[round(p.x, 2), round(p.y, 6), p.n] for _, p in sorted(self._points.items())]

    @classmethod
    def load(cls, rows: Iterable[Iterable[float]], signed: bool = False) -> "Curve":
        curve = cls(signed)
        for x, y, n in rows:
            curve._points[bucket(x)] = _Point(float(x), float(y), int(n))
        curve._index()
        return curve


#: the requests a load bucket's fit of step seconds against drafts needs before its slope is read (fewer say little
#: of a slope the prompt's length and the machine's noise also move)
MIN_FIT = 8


class _Moments:
    """One load bucket's running means of (drafts, seconds over the step curve), their squares and product, weighing
    recent samples more once it has many (as :class:`_Point`)."""

    __slots__ = ("load", "d", "s", "dd", "ds", "n")

    def __init__(self, load: float = 0.0, d: float = 0.0, s: float = 0.0, dd: float = 0.0, ds: float = 0.0,
                 n: int = 0) -> None:
        self.load, self.d, self.s, self.dd, self.ds, self.n = load, d, s, dd, ds, n

    def add(self, load: float, d: float, s: float) -> None:
        self.n += 1
        w = max(WEIGHT, 1.0 / self.n)
        self.load += (load - self.load) * w
        self.d += (d - self.d) * w
        self.s += (s - self.s) * w
        self.dd += (d * d - self.dd) * w
        self.ds += (d * s - self.ds) * w

    def slope(self) -> float | None:
        """Seconds a step per drafted token, by least squares over the bucket's requests (never below 0); None with
        fewer than :data:`MIN_FIT` of them or drafts that barely vary."""
        var = self.dd - self.d * self.d
        if self.n < MIN_FIT or var <= 1e-6:
            return None
        return max((self.ds - self.d * self.s) / var, 0.0)


class DraftFit:
    """What a drafting stream's step costs by the tokens its request drafts: each drafted token is verified by the
    step, accepted or not, so on a CPU a step that verifies five costs more than one that verifies none. Per log2
    bucket of the engine load, a least-squares line of a step's seconds over the step curve's at the load it was
    measured at (a bucket spans loads 1-1.99, 2-3.99, ...: against the seconds themselves, requests that met more
    load would read as drafting less or more) against the tokens its request was predicted to draft a step
    (``Features.drafts_per_step``: what a prediction knows of a request; the engine drafts fewer than the replay
    proposes, and the slope takes that in). :meth:`step` moves the step curve's seconds at a load along its
    bucket's slope, from the drafts the bucket's requests were predicted to draft to this request's."""

    def __init__(self) -> None:
        self.buckets: dict[int, _Moments] = {}

    def add(self, load: float, drafts: float, excess: float) -> None:
        """A request's step: its predicted drafts, and its seconds less the step curve's at ``load``."""
        if math.isfinite(excess) and drafts >= 0:
            self.buckets.setdefault(bucket(load), _Moments()).add(float(load), float(drafts), float(excess))

    def step(self, seconds: float, load: float, drafts: float) -> float:
        """``seconds`` (the step curve's at ``load``) for a request predicted to draft ``drafts`` a step; as it is
        while the bucket's slope is not known, or where the slope would leave nothing of a step drafting nothing."""
        fit = self.buckets.get(bucket(load))
        slope = fit.slope() if fit is not None else None
        if slope is None or seconds - slope * fit.d <= 0:
            return seconds
        return seconds + slope * (drafts - fit.d)

    def slopes(self) -> list[list[float | None]]:
        """Its buckets as ``[load, seconds a step per drafted token (None: not known yet), samples]``."""
        out = []
        for _, m in sorted(self.buckets.items()):
            slope = m.slope()
            out.append([round(m.load, 2), None if slope is None else round(slope, 6), m.n])
        return out

    def dump(self) -> list[list[float]]:
        """Its buckets as ``[load, drafts, excess, drafts squared, drafts x excess, samples]`` (running means; excess:
        a step's seconds over the step curve's)."""
        return [[round(m.load, 2), round(m.d, 4), round(m.s, 6), round(m.dd, 4), round(m.ds, 6), m.n]
                for _, m in sorted(self.buckets.items())]

    @classmethod
    def load(cls, rows: Iterable[Iterable[float]]) -> "DraftFit":
        fit = cls()
        for load, d, s, dd, ds, n in rows:
            fit.buckets[bucket(load)] = _Moments(float(load), float(d), float(s), float(dd), float(ds), int(n))
        return fit


@dataclass
class StreamCosts:
    """An engine stream's measured costs (plain requests, or its drafting requests)."""

    prefill: Curve
    step: Curve
    #: a request's seconds from submission to its last token (what a queued request waits per batch ahead)
    service: _Point
    #: a drafting stream's: the share of the drafting gain predicted for a request (its tokens per target step less
    #: one) that the engine delivered, against the requests on the engine (an engine that drafts less when busy
    #: delivers less of it there); empty for a plain stream
    draft_yield: Curve = field(default_factory=Curve)
    #: a drafting stream's: per engine load, its step's seconds against the tokens its requests were predicted to
    #: draft a step (empty for a plain stream)
    verify: DraftFit = field(default_factory=DraftFit)
    #: seconds a prompt's first token takes over the prefill curve's for the tokens computed, against the requests
    #: decoding on the engine when it arrived, no prompt queued (none, or prompts queued: what ``prefill`` measures):
    #: it waits for the step in flight and, on an engine that schedules its next step ahead, for that one too, and
    #: its own step carries their decodes
    join: Curve = field(default_factory=lambda: Curve(signed=True))
    #: finished requests it served, by kind of request (``features.Kind.name``): what its curves have seen of a
    #: kind, which a policy that explores reads (a curve fitted on other kinds predicts this one by extrapolation)
    served: dict[str, int] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "StreamCosts":
        return cls(Curve(), Curve(), _Point())

    @property
    def measured(self) -> bool:
        return self.prefill.measured and self.step.measured

    def dump(self) -> dict[str, Any]:
        out = {"prefill_s_by_tokens": self.prefill.dump(), "step_s_by_engine_load": self.step.dump(),
               "service_s": [round(self.service.y, 4), self.service.n]}
        if self.draft_yield.measured:
            out["draft_yield_by_engine_load"] = self.draft_yield.dump()
        if self.verify.buckets:
            out["step_excess_s_by_predicted_drafts"] = self.verify.dump()
        if self.join.measured:
            out["join_s_by_engine_load"] = self.join.dump()
        if self.served:
            out["served_by_kind"] = dict(sorted(self.served.items()))
        return out

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> "StreamCosts":
        service = data.get("service_s") or [0.0, 0]
        return cls(Curve.load(data["prefill_s_by_tokens"]), Curve.load(data["step_s_by_engine_load"]),
                   _Point(0.0, float(service[0]), int(service[1])),
                   Curve.load(data.get("draft_yield_by_engine_load", ())),
                   DraftFit.load(data.get("step_excess_s_by_predicted_drafts", ())),
                   Curve.load(data.get("join_s_by_engine_load", ()), signed=True),
                   {str(kind): int(n) for kind, n in data.get("served_by_kind", {}).items()})

