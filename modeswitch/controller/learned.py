"""The learned policy (``type: learned``): per running batch, online predictors of latency and energy; the
lowest predicted cost wins. The policy file's keys and defaults: docs/controller.md, "Learned policy".

Each batch has three recursive-least-squares models over a few features: time to first token from the tokens it
must prefill (the prompt minus what its prefix cache holds; linear and quadratic) and the queue in front of it;
time per output token from the context length and the queue; request energy from the prefill terms and the
output length. A request costs ``ttft + (max_tokens - 1) x tpot`` (and/or energy), and the policy picks the
cheapest mode that passed the gates. Every completed request updates its batch's models, so a mode that is slow
on this hardware is learned to be slow whatever a rule table would say. Modes that share one running batch (on
vLLM, the modes of one engine: :meth:`LearnedPolicy.bind`) differ only in per-request options the features
carry, so they share one set of models and are explored as one. A batch that drafts learns its time per target
step, and a request's time per token is that over the tokens per step :mod:`.speculation` predicts for it.

Why the cost and the exploration are shaped as they are:

* Every engine of a server runs on one device, so a request sent to one batch takes device time from the
  requests running on the others: a mode's cost adds, per request running on another batch, ``contention``
  times the request's latency alone (1: the engines take turns; 0: they do not compete).
* Exploration is bounded: each batch is tried ``min_samples`` times, then with probability
  ``epsilon / (1 + decisions / decay)`` a batch predicted within ``max_cost_ratio`` of the best is tried instead.
* A batch explored under load slows every request in flight and learns contended timings. So while the requests
  in flight all run in batching engines a cold batch waits for an idle server, and where a batching mode is
  known also for a lull (the load the last arrivals found, :data:`LOAD_WEIGHT`, below ``explore.max_load``): an
  idle instant inside a busy spell is not one. Where the busy mode serves one request at a time its queue grows,
  and trying another mode is how the policy finds out: there exploration does not wait.
* A batch tried but not yet observed (its first requests still running) predicts nothing: observed ones go first.
  A consequence to know: under sustained load the load stays on the batch in use when the busy spell began
  (moving a request costs the others more than it saves).
"""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..files import replace_whole
from ..yamlconf import Section
from .completed import Completed
from .features import Features
from .online import OnlineLinear
from .policy import COMMON_KEYS, Choice, EnergyPolicy, MemoryPolicy
from .quality import QualityPolicy
from .speculation import tokens_per_step
from .verdicts import Verdict

log = logging.getLogger(__name__)

#: observations between two writes of the state file
SAVE_EVERY = 10
#: weight of each arrival in the moving mean of the requests arrivals find in flight (about the last ten)
LOAD_WEIGHT = 0.1
#: the state file's layout (feature order, what each model keeps): a file of another version is not read
STATE_VERSION = 3


def _prefill_tokens(mode: str, f: Features) -> float:
    """Thousands of prompt tokens ``mode`` must prefill: what its prefix cache holds is skipped."""
    return (f.prompt_tokens - f.prefix_match_by_mode.get(mode, 0)) / 1000.0


def _queue(f: Features, batch: tuple[str, ...]) -> int:
    """Requests in flight in the running batch a mode shares (``batch``: its modes)."""
    return sum(f.in_flight_by_mode.get(m, 0) for m in batch)


def ttft_x(mode: str, f: Features, batch: tuple[str, ...] = ()) -> list[float]:
    u = _prefill_tokens(mode, f)
    return [1.0, u, u * u, float(_queue(f, batch or (mode,))), float(f.queue_depth)]


def tpot_x(mode: str, f: Features, batch: tuple[str, ...] = ()) -> list[float]:
    return [1.0, f.prompt_tokens / 1000.0, float(_queue(f, batch or (mode,))), float(f.queue_depth)]


def energy_x(mode: str, f: Features) -> list[float]:
    u = _prefill_tokens(mode, f)
    return [1.0, f.max_tokens / 100.0, u, u * u, float(f.queue_depth)]


@dataclass
class ModeModel:
    """What the policy has learned about one mode, or about the modes sharing one running batch. ``batch``
    arguments name those modes (empty: ``mode`` alone): their requests in flight are the queue in front."""

    forgetting: float
    #: the batch drafts (speculative decoding): its time model is per target step, and a request's time per token
    #: is that over the tokens per step predicted for it (``Features.draft_tokens_per_step``)
    drafts: bool = False
    ttft: OnlineLinear = field(init=False)
    tpot: OnlineLinear = field(init=False)
    energy: OnlineLinear = field(init=False)

    def __post_init__(self) -> None:
        # while few requests have been seen: first token from the tokens to prefill, a mean time per token,
        # request energy from the output length (the heads: the leading features of each vector)
        self.ttft = OnlineLinear(5, self.forgetting, head=2)
        self.tpot = OnlineLinear(4, self.forgetting, head=1)
        self.energy = OnlineLinear(5, self.forgetting, head=2)

    @property
    def n(self) -> int:
        """Requests observed: every one updates the first-token model."""
        return self.ttft.n

    def latency(self, mode: str, f: Features, batch: tuple[str, ...] = ()) -> float:
        """Seconds predicted for a request with features ``f``: first token, then ``max_tokens - 1`` more.

        The dot products with :func:`ttft_x` and :func:`tpot_x` written out: this runs for every mode on
        every request, and building the feature lists would take most of the decision's time (a test keeps
        the two forms equal). A prefix the mode's cache holds never makes the first token later: the prefill
        terms are fitted to first-token times that the queue dominates, and where their fit slopes down, a
        cache-reading mode would be predicted slower than its sibling in the same batch for the same request, and
        shared-prefix requests sent past the cache; so the prediction is at most the one for prefilling the whole
        prompt."""
        return self._latency(mode, f, _queue(f, batch or (mode,)), f.queue_depth)

    def latency_alone(self, mode: str, f: Features) -> float:
        """Seconds predicted for the request on an idle server: the device time it takes."""
        return self._latency(mode, f, 0, 0)

    def _latency(self, mode: str, f: Features, q: int, d: int) -> float:
        u, whole = _prefill_tokens(mode, f), f.prompt_tokens / 1000.0
        a, b = self.ttft._w, self.tpot._w
        ttft = a[0] + a[1] * u + a[2] * u * u + a[3] * q + a[4] * d
        if u < whole:  # no later than prefilling the whole prompt (see above)
            ttft += min(0.0, a[1] * (whole - u) + a[2] * (whole * whole - u * u))
        tpot = b[0] + b[1] * f.prompt_tokens / 1000.0 + b[2] * q + b[3] * d
        if self.drafts:
            tpot /= max(f.draft_tokens_per_step, 1.0)
        return max(ttft, 0.0) + max(f.max_tokens - 1, 0) * max(tpot, 0.0)

    def energy_j(self, mode: str, f: Features) -> float:
        return max(self.energy.predict(energy_x(mode, f)), 0.0)

    def update(self, mode: str, f: Features, ttft_s: float, tpot_s: float | None, energy_j: float | None,
               batch: tuple[str, ...] = (), tokens_per_step: float | None = None) -> None:
        """``tokens_per_step``: what drafting yielded for this request (a drafting batch learns per target step;
        without it a drafting batch learns no time per token from the request)."""
        self.ttft.update(ttft_x(mode, f, batch), ttft_s)
        if self.drafts and tpot_s is not None:
            tpot_s = tpot_s * tokens_per_step if tokens_per_step else None
        if tpot_s is not None:
            self.tpot.update(tpot_x(mode, f, batch), tpot_s)
        if energy_j is not None:
            self.energy.update(energy_x(mode, f), energy_j)

    def to_dict(self) -> dict:
        return {"ttft": self.ttft.to_dict(), "tpot": self.tpot.to_dict(), "energy": self.energy.to_dict()}

    def load(self, data: dict) -> None:
        for name in ("ttft", "tpot", "energy"):
            getattr(self, name).load(data[name])


@dataclass(frozen=True)
class Exploration:
    min_samples: int = 2
    epsilon: float = 0.05
    decay: float = 200.0
    max_cost_ratio: float = 1.5
    max_load: float = 1.0
    seed: int = 0


@dataclass(eq=False)
class LearnedPolicy:
    name: str
    modes: tuple[str, ...]
    w_latency: float = 1.0
    w_energy: float = 0.0
    explore: Exploration = Exploration()
    forgetting: float = 0.995
    contention: float = 1.0
    state_path: Path | None = None
    warm_start_path: Path | None = None
    source: str = ""
    description: str = ""
    quality: QualityPolicy = QualityPolicy()
    energy: EnergyPolicy = EnergyPolicy()
    memory: MemoryPolicy = MemoryPolicy()
    models: dict[str, ModeModel] = field(init=False)

    def __post_init__(self) -> None:
        self.decisions = 0
        #: moving mean of the requests in flight that arrivals found (the recent load, see LOAD_WEIGHT)
        self.load = 0.0
        self.chosen = {m: 0 for m in self.modes}
        self._since_save = 0
        self._lock = threading.Lock()
        self._rng = random.Random(self.explore.seed)
        self.batching: frozenset[str] = frozenset()
        self.drafting: frozenset[str] = frozenset()
        self._saved = self._read_saved()
        self.siblings: dict[str, tuple[str, ...]] = {}
        self.models = {}
        self._group({})

    def _read_saved(self) -> tuple[str, Any] | None:
        """What the models start from, read once: the state file if there is one, else the warm start's
        records. Kept in memory because binding regroups the models and fills them again."""
        if self.state_path is not None and self.state_path.is_file():
            data = json.loads(self.state_path.read_text())
            if data.get("version") == STATE_VERSION:
                log.info("learned policy %s: state restored from %s", self.name, self.state_path)
                return "state", data
            log.warning("learned policy %s: %s was written by another version of the model; not read (it is "
                        "replaced at the next save)", self.name, self.state_path)
        if self.warm_start_path is not None:
            log.info("learned policy %s: warm start from %s", self.name, self.warm_start_path)
            return "warm_start", json.loads(self.warm_start_path.read_text())["records"]
        return None

    def _group(self, batches: Mapping[str, str]) -> None:
        """One model per running batch, shared by its modes. A group whose modes are unchanged keeps its model
        and what it learned (modes of a staged start join their batches when they come up); a new group's
        model is filled from the state file or the warm start."""
        groups: dict[str, tuple[str, ...]] = {}
        for m in self.modes:
            key = batches.get(m) or m
            groups[key] = (*groups.get(key, ()), m)
        kept = {group[0]: self.models[group[0]] for group in groups.values()
                if all(self.siblings.get(m) == group for m in group) and self.models[group[0]].drafts == (group[0] in self.drafting)}
        fresh = {group[0]: ModeModel(self.forgetting, group[0] in self.drafting) for group in groups.values()
                 if group[0] not in kept}
        shared = {**kept, **fresh}
        #: per mode, the modes sharing its running batch (itself included)
        self.siblings = {m: group for group in groups.values() for m in group}
        self.models = {m: shared[self.siblings[m][0]] for m in self.modes}
        if self._saved is not None and fresh:
            kind, data = self._saved
            new = {m for m in self.modes if self.siblings[m][0] in fresh}
            self._load_state(data, new) if kind == "state" else self._replay(data, new)

    @property
    def first_modes(self) -> tuple[str, ...]:
        """Any mode may win a plain request: the file's order."""
        return self.modes

    @property
    def orders_by_measurement(self) -> bool:
        """It orders by what it learned of each mode, not by the engines' measured costs."""
        return False

    @property
    def tested_features(self) -> frozenset[str]:
        """No rules: its models read the counts every request carries."""
        return frozenset()

    def describe(self) -> dict[str, Any]:
        """The policy as ``GET /admin/policy`` shows it, with how much each mode has been observed."""
        return {"name": self.name, "type": "learned", "source": self.source, "description": self.description,
                "modes": list(self.modes), "objective": {"latency": self.w_latency, "energy": self.w_energy},
                "contention": self.contention, "explore": vars(self.explore), "decisions": self.decisions,
                "recent_load": round(self.load, 3),
                "observations": {m: model.n for m, model in self.models.items()},
                "shared_batches": sorted({s for s in self.siblings.values() if len(s) > 1}),
                "state": str(self.state_path) if self.state_path else None}

    def bind(self, batches: Mapping[str, str], batching: frozenset[str] = frozenset(),
             drafting: frozenset[str] = frozenset()) -> None:
        """Share one model among the modes of each running batch (modes the server does not name run alone);
        ``batching``: the modes whose engine batches requests; ``drafting``: those that decode speculatively.
        Called by the controller before the policy decides anything; what was restored fills the new models."""
        with self._lock:
            self.batching, self.drafting = frozenset(batching), frozenset(drafting)
            self._group(batches)

    # ------------------------------------------------------------------ deciding
    def elsewhere(self, mode: str, f: Features) -> int:
        """Requests in flight on other batches than ``mode``'s (all the server's modes, not only the policy's)."""
        return f.queue_depth - _queue(f, self.siblings.get(mode, (mode,)))

    def batched_load(self, f: Features) -> bool:
        """Whether requests are in flight and every one of them runs in a batching engine (none queues)."""
        busy = [m for m, n in f.in_flight_by_mode.items() if n > 0]
        return bool(busy) and all(m in self.batching for m in busy)

    def busy_spell(self, known: list[str]) -> bool:
        """Whether trying another batch now would slow the requests that keep arriving: the recent load is at
        least ``explore.max_load`` and a known mode batches them (without one, exploring is how a queue is
        relieved)."""
        return self.load >= self.explore.max_load and any(m in self.batching for m in known)

    def cost(self, mode: str, f: Features) -> float:
        """The objective for ``mode``: weighted predicted latency, with the contention it causes the requests
        running on other batches, and energy (a zero weight costs nothing)."""
        model = self.models[mode]
        cost = 0.0
        if self.w_latency:
            latency = model.latency(mode, f, self.siblings[mode])
            others = self.elsewhere(mode, f)
            if others > 0 and self.contention:
                latency += self.contention * others * model.latency_alone(mode, f)
            cost = self.w_latency * latency
        return cost + self.w_energy * model.energy_j(mode, f) if self.w_energy else cost

    def choose(self, features: Features, filtered: Mapping[str, Verdict], predict=None, energy=None) -> Choice:
        """The cheapest mode by the policy's own learned models (``predict``, the engines' measured costs, and
        ``energy``, the modes' running watts, are not what it learns from: it weighs its own energy model)."""
        eligible = [m for m in self.modes if m not in filtered]
        if not eligible:
            skipped = "; ".join(f"{m}: {filtered[m]}" for m in self.modes)
            return Choice(None, f"no eligible mode: {skipped}", None)
        self.decisions += 1
        self.load += LOAD_WEIGHT * (features.queue_depth - self.load)
        # a batch has been tried as often as it was observed, or chosen (counting requests in flight)
        tried = {m: max(self.models[m].n, sum(self.chosen[s] for s in self.siblings[m])) for m in eligible}
        cold = [m for m in eligible if tried[m] < self.explore.min_samples]
        known = [m for m in eligible if m not in cold]
        ready = cold
        if cold and self.batched_load(features):
            # explored under a batched load, a cold batch would slow every request in flight: it waits for an
            # idle server, unless nothing has been tried yet (then the batch already running goes first)
            running = {s for m, n in features.in_flight_by_mode.items() if n > 0 for s in self.siblings.get(m, (m,))}
            ready = [] if known else [m for m in cold if m in running] or cold
        elif cold and self.busy_spell(known):
            ready = []  # idle for an instant inside a busy spell: the next arrivals would run beside it
        if ready:
            mode = min(ready, key=tried.__getitem__)
            self.chosen[mode] += 1
            return Choice(mode, f"exploring {mode}: tried {tried[mode]} of {self.explore.min_samples} times",
                          "explore", {"explore": True})
        # a batch tried but not yet observed (its requests still running) predicts nothing: the observed go first
        known = [m for m in known if self.models[m].n > 0] or known
        costs = {m: self.cost(m, features) for m in known}
        # on a tie (siblings in one batch), the mode whose cache holds more of the prompt
        best = min(known, key=lambda m: (costs[m], -features.prefix_match_by_mode.get(m, 0)))
        mode, rule = best, "learned"
        epsilon = self.explore.epsilon / (1 + self.decisions / self.explore.decay)
        if len(known) > 1 and self._rng.random() < epsilon and not self.busy_spell(known):
            # another batch: the best's siblings share its models, so trying one teaches nothing
            near = [m for m in known if self.siblings[m] != self.siblings[best]
                    and costs[m] <= self.explore.max_cost_ratio * costs[best]]
            if near:
                mode, rule = self._rng.choice(near), "explore"
        self.chosen[mode] += 1
        model = self.models[mode]
        latency, energy = model.latency(mode, features, self.siblings[mode]), model.energy_j(mode, features)
        ranked = ", ".join(f"{m} {costs[m]:.3g}" for m in sorted(known, key=costs.__getitem__))
        what = "exploring" if rule == "explore" else "lowest predicted cost"
        reason = f"{what}: {mode} (predicted {latency:.3f} s, {energy:.3g} J; costs: {ranked})"
        return Choice(mode, reason, rule, {"latency_s": round(latency, 5), "energy_j": round(energy, 5),
                                           "explore": rule == "explore"})

    def energy_cap(self, mode: str, features: Features) -> tuple[float, str] | None:
        """The energy block's caps alone: the learned policy has no per-request caps."""
        return self.energy.cap(mode)

    @property
    def caps_energy(self) -> bool:
        return self.energy.capped

    # ------------------------------------------------------------------ learning
    def observe(self, completed: Completed) -> None:
        """Fold a completed request into its mode's models. Only clean measurements teach: served well
        (``ok``), a generation (prompt scoring costs differ), on one mode (a retried request's timings span
        two), with a first token; modes outside the policy are ignored."""
        c = completed
        model = self.models.get(c.mode)
        if model is None or c.outcome != "ok" or c.scoring or c.retried or c.ttft_s is None:
            return
        with self._lock:
            model.update(c.mode, c.features, c.ttft_s, c.tpot_s, c.energy_j, self.siblings[c.mode],
                         tokens_per_step(c.completion_tokens, c.target_steps))
            self._since_save += 1
            if self.state_path is not None and self._since_save >= SAVE_EVERY:
                self.save()

    def _replay(self, records: list[dict], modes: set[str]) -> None:
        """Replay a benchmark run's per-request records (``benchmarks/run.py`` JSON's ``records``) on ``modes``."""
        used = 0
        for r in records:
            if r.get("mode") in modes and r.get("ok") and r.get("features"):
                f = features_from(r["features"])
                steps = (r.get("speculative") or {}).get("target_steps")
                self.models[r["mode"]].update(r["mode"], f, r["ttft_s"], r.get("tpot_s"), r.get("energy_j"),
                                              self.siblings[r["mode"]], tokens_per_step(r.get("tokens", 0), steps))
                used += 1
        log.debug("learned policy %s: %d warm-start records replayed", self.name, used)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "name": self.name, "decisions": self.decisions,
                "modes": {m: model.to_dict() for m, model in self.models.items()}}

    def save(self) -> None:
        """Write the state atomically (a crash never leaves half a file)."""
        if self.state_path is None:
            return
        replace_whole(self.state_path, json.dumps(self.state()))
        self._since_save = 0

    def _load_state(self, data: dict, modes: set[str]) -> None:
        """Fill the models of ``modes`` from a saved state."""
        for mode, saved in data.get("modes", {}).items():
            # modes sharing a batch share a model: the one saved with the most observations fills it
            if mode in modes and int(saved["ttft"]["n"]) >= self.models[mode].n:
                self.models[mode].load(saved)
        self.decisions = max(self.decisions, int(data.get("decisions", 0)))


def features_from(d: Mapping[str, Any]) -> Features:
    """Features from their JSON form (a response's ``modeswitch.features``)."""
    return Features(**{k: v for k, v in d.items() if k in Features.__dataclass_fields__})


def parse_learned(sec: Section, known: set[str], common: dict[str, Any]) -> LearnedPolicy:
    """A ``type: learned`` policy; ``common``: the blocks every policy has (see ``policy.parse_common``)."""
    source = sec.source
    sec.only(COMMON_KEYS | {"modes", "objective", "contention", "explore", "forgetting", "state", "warm_start"})
    modes = sec.get("modes", list, sorted(known))
    for m in modes:
        if m not in known:
            raise sec.error(f"unknown mode {m!r} (modes: {', '.join(sorted(known))})", "modes")
    if not modes:
        raise sec.error("must name at least one mode", "modes")
    objective = sec.section("objective", Section({}, source, "objective"))
    objective.only({"latency", "energy"})
    # an objective that names energy alone weighs latency 0
    w_latency = float(objective.get("latency", (int, float),
                                    LearnedPolicy.w_latency if "energy" not in objective.data else 0.0))
    w_energy = float(objective.get("energy", (int, float), LearnedPolicy.w_energy))
    if w_latency < 0 or w_energy < 0 or w_latency + w_energy == 0:
        raise objective.error("weights must be >= 0 and not both 0")
    ex = sec.section("explore", Section({}, source, "explore"))
    counts, reals = ("min_samples", "seed"), ("epsilon", "decay", "max_cost_ratio", "max_load")
    ex.only({*counts, *reals})
    explore = Exploration(**{k: ex.get(k, int, getattr(Exploration, k)) for k in counts},
                          **{k: float(ex.get(k, (int, float), getattr(Exploration, k))) for k in reals})
    if (not 0 <= explore.epsilon <= 1 or explore.decay <= 0 or explore.max_cost_ratio < 1 or explore.min_samples < 0
            or explore.max_load <= 0):
        raise ex.error("needs 0 <= epsilon <= 1, decay > 0, max_cost_ratio >= 1, min_samples >= 0, max_load > 0")
    forgetting = float(sec.get("forgetting", (int, float), LearnedPolicy.forgetting))
    if not 0.5 < forgetting <= 1:
        raise sec.error(f"must be in (0.5, 1], got {forgetting}", "forgetting")
    contention = float(sec.get("contention", (int, float), LearnedPolicy.contention))
    if contention < 0:
        raise sec.error(f"must be >= 0, got {contention}", "contention")
    base = Path(source).parent

    def path(key: str) -> Path | None:
        value = sec.get(key, str, None)
        return None if value is None else (base / value if not Path(value).is_absolute() else Path(value))

    warm = path("warm_start")
    if warm is not None and not warm.is_file():
        raise sec.error(f"no such file: {warm}", "warm_start")
    return LearnedPolicy(modes=tuple(modes), w_latency=w_latency, w_energy=w_energy, explore=explore,
                         forgetting=forgetting, contention=contention, state_path=path("state"),
                         warm_start_path=warm, **common)
