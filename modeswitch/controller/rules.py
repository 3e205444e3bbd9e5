"""Rule policies from YAML: ordered rules over request features, first match wins.

```yaml
name: paper
rules:
  - name: shared-prefix
    when: {prefix_match_tokens: {ge: 256}}
    use: [gptq+prefix_cache, prefix_cache]   # first one that passes the gates
    prefer: prefix_match                     # optional: try modes holding a longer prefix of the prompt first
    energy: {max_j_per_token: 0.5}           # optional: for requests this rule matches, skip modes above this
default: [fp16]                              # when no rule matches
order: listed        # listed: the first mode of the list that passes the gates; predicted: of the modes in the
                     # list that pass, the one the measured costs predict to finish first; energy: of those
                     # predicted within latency_slack of the first, the one of least predicted joules (a rule may
                     # say its own)
latency_slack: 1.25  # with order: energy, how much longer than the fastest a request may be predicted to take
explore: {within: 1.5, requests: 2}   # with order: predicted, optional: see below
fallback: [fp16]                             # tried after a rule's (or the default's) own list
quality: {max_drop_pp: 1.0}                  # the quality gate's tolerances (see QualityPolicy)
energy: {max_j_per_token: 2.0, modes: {int8: 1.0}}   # energy gate: caps on each mode's running J/token
memory: {min_headroom: 0.05}                 # memory gate: below this free fraction, only preallocated-KV modes
```

Conditions are compiled to ``(feature, operator, value)`` triples at load, so matching a request is a
few attribute reads and comparisons.

With ``order: predicted`` the rules constrain and the measurements order: a rule (or the default) names the
modes a kind of request may use, and among those the gates pass the controller's cost model
(:mod:`.costs`) picks the one predicted to finish first, counting the delay it adds to the requests already
on its lane. A mode whose engine has not measured its costs yet is not compared on a guess: measured modes
come first, the rest in the list's order. ``order: listed`` keeps the list a strict order (``paper.yaml``
keeps the published table so).

With ``explore`` an ordering by prediction also learns what it would not see otherwise: a request goes to a drafting
mode predicted within ``within`` times the fastest one's time whose engine stream has served fewer than
``requests`` of its kind (task, prompt length, how much the prompt repeats itself: :class:`~.features.Kind`),
where nothing runs on that mode's cores (:meth:`.costs.CostModel.predictor`'s ``explore``). A drafting stream's
curves predict a kind it never served from the kinds it did, and nothing corrects a prediction that keeps a kind
away: on the AVX2 EPYC the int8 drafting engine priced prose 20-25 % over what it took there, on the AVX-512 EPYC
copying requests 10-50 %.

With ``order: energy`` the measurements order by energy within a latency budget: of the modes predicted to finish
within ``latency_slack`` times the fastest one's time, the one predicted to use the fewest joules: its own
predicted seconds for this request at the watts its mode's completed requests drew while they ran (the registry's
running figure, from energy measured where a meter reads the device and estimated otherwise, as the response
says). Not a mode's joules per token: that figure is as much the mix of requests it happened to serve (short
answers to long prompts cost more per token anywhere) as the mode. A mode with no figure yet is not compared on a
guess either: where no mode within the slack has one, the fastest serves (and so gets one).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any, Callable, Iterable, Mapping

from ..yamlconf import Section
from .completed import Completed
from .costs import Predict, Prediction
from .features import FEATURE_DOCS, Features
from .policy import COMMON_KEYS, Choice, EnergyPolicy, MemoryPolicy, positive
from .quality import QualityPolicy
from .verdicts import Verdict

OPERATORS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge, "eq": operator.eq,
             "ne": operator.ne}
SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


@dataclass(frozen=True)
class Condition:
    feature: str
    op: str
    value: float

    def holds(self, features: Features) -> bool:
        """Whether the request's feature meets it; a feature not computed for the request (None: the policy was
        reloaded between its features and its decision) meets nothing."""
        value = getattr(features, self.feature)
        return value is not None and OPERATORS[self.op](value, self.value)

    def explain(self, features: Features) -> str:
        return f"{self.feature}={getattr(features, self.feature):g} {SYMBOLS[self.op]} {self.value:g}"


PREFER = ("prefix_match",)
ORDERS = ("listed", "predicted", "energy")
#: the orders that read the cost model's predictions
MEASURED_ORDERS = ("predicted", "energy")


@dataclass(frozen=True)
class Rule:
    name: str
    conditions: tuple[Condition, ...]
    use: tuple[str, ...]
    prefer: str | None = None
    max_j_per_token: float | None = None  # energy cap for the requests this rule matches
    order: str | None = None  # None: the policy's

    def candidates(self, features: Features) -> tuple[str, ...]:
        """The rule's modes in the order to try them (stable: ties keep the file's order)."""
        if self.prefer == "prefix_match":
            held = features.prefix_match_by_mode
            return tuple(sorted(self.use, key=lambda m: -held.get(m, 0)))
        return self.use

    def matches(self, features: Features) -> bool:
        for c in self.conditions:
            if not c.holds(features):
                return False
        return True

    @property
    def energy_cap(self) -> tuple[float, str] | None:
        """The rule's own J/token cap and its label, for :meth:`EnergyPolicy.cap`."""
        return None if self.max_j_per_token is None else (self.max_j_per_token, f"rule {self.name!r}")


class _LastMatch:
    """The rule matched for the last features object seen. The energy gate asks for every mode with the
    same features object; walking the rules once per request, not once per mode, keeps decisions cheap.
    The pair is swapped whole, so concurrent requests never see one request's features with another's rule."""

    __slots__ = ("pair",)

    def __init__(self) -> None:
        self.pair: tuple[Features | None, Rule | None] = (None, None)


@dataclass(frozen=True)
class Explore:
    """``explore``: how much slower than the fastest a mode may be predicted for a request to go there to be
    measured on its kind (a factor >= 1), and how many requests of a kind a stream serves before it is not."""

    within: float
    requests: int


@dataclass(frozen=True)
class RulePolicy:
    name: str
    rules: tuple[Rule, ...]
    default: tuple[str, ...]
    fallback: tuple[str, ...]
    source: str = ""
    description: str = ""
    quality: QualityPolicy = QualityPolicy()
    energy: EnergyPolicy = EnergyPolicy()
    memory: MemoryPolicy = MemoryPolicy()
    order: str = "listed"
    #: with ``order: energy``: the most a mode's predicted time may exceed the fastest's, as a factor (>= 1)
    latency_slack: float = 1.25
    #: with ``order: predicted``: which runners-up a request may go to for their streams to measure its kind
    explore: Explore | None = None
    _last_match: _LastMatch = field(default_factory=_LastMatch, init=False, repr=False, compare=False)

    def describe(self) -> dict[str, Any]:
        """The policy as ``GET /admin/policy`` shows it."""
        return {"name": self.name, "type": "rules", "source": self.source, "description": self.description,
                "rules": [{"name": r.name, "use": list(r.use), "when": [f"{c.feature} {c.op} {c.value:g}"
                                                                       for c in r.conditions]} for r in self.rules],
                "default": list(self.default), "fallback": list(self.fallback), "order": self.order,
                **({"latency_slack": self.latency_slack} if self.uses_energy_order else {}),
                **({"explore": vars(self.explore)} if self.explore is not None else {})}

    def match(self, features: Features) -> Rule | None:
        """The first rule whose conditions hold, or None (the default list applies)."""
        for r in self.rules:
            if r.matches(features):
                return r
        return None

    def choose(self, features: Features, filtered: Mapping[str, Verdict], predict: Predict | None = None,
               energy: Callable[[str], float | None] | None = None) -> Choice:
        """A mode of the matching rule's list (then the fallback list) that no gate filtered: the first one, or
        with ``order: predicted`` (and ``predict``) the one predicted to finish first, or with ``order: energy``
        (and ``energy``, a mode's running watts) the least predicted energy within the latency slack. The reason is
        written when read (see :class:`~.policy.Choice`)."""
        rule = self.match(features)
        groups = self._groups(rule.candidates(features)) if rule is not None else self._default_groups
        order = (rule.order if rule is not None and rule.order else self.order) if predict is not None else "listed"
        rule_name = rule.name if rule else None
        for i, group in enumerate(groups):
            admitted = [name for name in group if name not in filtered]
            if not admitted:
                continue
            explain = _Explain(rule, features, filtered, groups[:i + 1], fallback=i > 0)
            if order in MEASURED_ORDERS:
                by_energy = (self.latency_slack, energy) if order == "energy" and energy is not None else None
                return _fastest(admitted, predict, explain, rule_name, by_energy,
                                self.explore if order == "predicted" else None)
            return Choice(admitted[0], partial(explain.listed, admitted[0]), rule_name)
        return Choice(None, _Explain(rule, features, filtered, groups, fallback=False).none, rule_name)

    def _groups(self, candidates: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The modes to try: ``candidates``, then the fallback modes not among them."""
        return candidates, tuple(m for m in self.fallback if m not in candidates)

    @cached_property
    def _default_groups(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """:meth:`_groups` of the default list, for the requests no rule matches (most): worked out once."""
        return self._groups(self.default)

    @property
    def first_modes(self) -> tuple[str, ...]:
        """A request no rule matches goes to the default list, then the fallback."""
        return tuple(_unique(self.default + self.fallback))

    @property
    def orders_by_measurement(self) -> bool:
        return self.order in MEASURED_ORDERS

    @cached_property
    def uses_energy_order(self) -> bool:
        return self.order == "energy" or any(r.order == "energy" for r in self.rules)

    @cached_property
    def tested_features(self) -> frozenset[str]:
        return frozenset(c.feature for r in self.rules for c in r.conditions)

    @cached_property
    def caps_energy(self) -> bool:
        """Whether the policy or any rule caps energy at all (most do not: the energy gate then asks nothing)."""
        return self.energy.capped or any(r.max_j_per_token is not None for r in self.rules)

    def energy_cap(self, mode: str, features: Features) -> tuple[float, str] | None:
        """The policy's caps on ``mode``, and the matching rule's for this request."""
        if not self.caps_energy:
            return None
        last_features, rule = self._last_match.pair
        if last_features is not features:
            rule = self.match(features)
            self._last_match.pair = (features, rule)
        return self.energy.cap(mode, rule.energy_cap if rule is not None else None)

    def observe(self, completed: Completed) -> None:
        """Rules do not learn."""

    def save(self) -> None:
        """Nothing learned, nothing to save."""

    def bind(self, batches: Mapping[str, str], batching: frozenset[str] = frozenset(),
             drafting: frozenset[str] = frozenset()) -> None:
        """A rule table names its modes itself: which share a batch changes nothing."""


class _Explain:
    """Writes a rule policy's reason when it is read: the rule (or the default) and its conditions, the mode
    chosen and why, and the modes of its lists a gate skipped."""

    __slots__ = ("rule", "features", "filtered", "groups", "fallback")

    def __init__(self, rule: Rule | None, features: Features, filtered: Mapping[str, Verdict],
                 groups: tuple[tuple[str, ...], ...], fallback: bool) -> None:
        self.rule, self.features, self.filtered, self.groups, self.fallback = rule, features, filtered, groups, fallback

    def why(self) -> str:
        """The rule that matched, with its conditions as this request meets them (or the default)."""
        rule = self.rule
        if rule is None:
            return "no rule matched: default"
        return f"rule {rule.name!r} ({', '.join(c.explain(self.features) for c in rule.conditions) or 'always'})"

    @property
    def via(self) -> str:
        return " (fallback)" if self.fallback else ""

    def skipped(self) -> list[str]:
        return [f"{name}: {self.filtered[name]}" for group in self.groups for name in group if name in self.filtered]

    def tail(self) -> str:
        skipped = self.skipped()
        return f"; skipped {'; '.join(skipped)}" if skipped else ""

    def listed(self, mode: str) -> str:
        return f"{self.why()} -> {mode}{self.via}{self.tail()}"

    def none(self) -> str:
        return f"{self.why()}; no eligible mode: {'; '.join(self.skipped())}"


def _fastest(admitted: list[str], predict: Predict, explain: _Explain, rule: str | None,
             by_energy: tuple[float, Callable[[str], float | None]] | None = None,
             explore: Explore | None = None) -> Choice:
    """The admitted mode predicted to finish first (measured modes before unmeasured ones, ties and the
    unmeasured in the list's order), with the prediction of it and of the runner-up: the best mode predicted
    otherwise (modes on one engine stream with the same prompt to compute share one prediction). A mode whose
    engine is idle by measurement (slower at every load than another on its cores, ``predict.idle``) is compared
    only when no other mode has a prediction: its own time may look shorter while the faster engine is busy, but
    its steps take the cores from that engine's, which the greedy sum of one request's own time and delay does not
    see. So it is not even predicted while another mode is.

    ``by_energy`` (the latency slack, a mode's running watts): of the modes predicted within the slack of the first,
    the one of least predicted joules (its own predicted seconds at its watts; ties by time), where any of them has
    a figure; the runner-up is then the fastest.

    ``explore``: the first mode, fastest first, predicted within its factor of the fastest one's time that
    ``predict.explore`` says its stream should measure on this kind, if any; the runner-up is then the fastest."""
    idle = getattr(predict, "idle", frozenset())
    predicted = [(p.total, i, name, p) for i, name in enumerate(admitted)
                 if name not in idle and (p := predict(name)) is not None]
    fallback = not predicted and any(name in idle for name in admitted)
    if fallback:
        predicted = [(p.total, i, name, p) for i, name in enumerate(admitted)
                     if name in idle and (p := predict(name)) is not None]
    if not predicted:
        return Choice(admitted[0], lambda: f"{explain.why()}{explain.via} -> {admitted[0]} (no mode measured yet: "
                                           f"the list's order){explain.tail()}", rule)
    best = min(predicted)  # (total, list index, ...): the index settles every tie
    energy = None
    if by_energy is not None:
        slack, watts = by_energy
        within = [(w * t[3].own_s, t) for t in predicted if t[0] <= best[0] * slack and (w := watts(t[2])) is not None]
        energy = (None, slack)
        if within:
            joules, frugal = min(within, key=lambda jt: (jt[0], jt[1][:2]))
            energy, best = (joules, slack), frugal
    explored = None
    if explore is not None and not fallback and (asks := getattr(predict, "explore", None)) is not None:
        limit = best[0] * explore.within
        for t in sorted(t for t in predicted if t is not best and t[0] <= limit):  # (total, list index, ...)
            if (why := asks(t[2], best[2], explore.requests)) is not None:
                explored, best = (best, *why), t
                break
    ranked = _Ranked(best, predicted, admitted, idle, fallback, explain, energy, explored)
    return Choice(best[2], ranked.reason, rule, ranked.prediction)


class _Ranked:
    """What :func:`_fastest` predicted, written when read: the chosen mode's prediction and the runner-up's (the best
    mode predicted otherwise), and the modes it left alone."""

    __slots__ = ("best", "predicted", "admitted", "idle", "fallback", "explain", "energy", "explored")

    def __init__(self, best: tuple, predicted: list[tuple], admitted: list[str], idle: frozenset[str],
                 fallback: bool, explain: _Explain, energy: tuple[float | None, float] | None = None,
                 explored: tuple | None = None) -> None:
        self.best, self.predicted, self.admitted, self.idle = best, predicted, admitted, idle
        self.fallback, self.explain = fallback, explain
        #: ordered by energy: the chosen mode's predicted joules (None: no mode within the slack has a figure yet, so
        #: the fastest) and the latency slack
        self.energy = energy
        #: exploring: (the fastest mode's ranked tuple, the requests of this kind the chosen one's stream served, the
        #: kind)
        self.explored = explored

    def runner_up(self) -> tuple[str, Prediction] | None:
        p = self.best[3]
        return next(((name, q) for *_, name, q in sorted(self.predicted, key=lambda t: t[:2]) if q is not p), None)

    def prediction(self) -> dict[str, Any]:
        out = {"chosen": {"mode": self.best[2], **self.best[3].as_dict()}}
        if (second := self.runner_up()) is not None:
            out["runner_up"] = {"mode": second[0], **second[1].as_dict()}
        return out

    def reason(self) -> str:
        *_, best, p = self.best
        text = f"{self.explain.why()}{self.explain.via} -> {best}, predicted {p.total:.3g} s"
        if self.explored is not None:
            fastest, served, kind = self.explored
            text += (f", exploring: its engine stream has served {served} request(s) of this kind ({kind}), the "
                     f"fastest {fastest[2]} {fastest[0]:.3g} s")
        elif self.energy is not None and self.energy[0] is not None:
            text += f", least energy within {self.energy[1]:g}x of the fastest: {self.energy[0]:.3g} J predicted"
        elif self.energy is not None:
            text += f", the fastest: no mode within {self.energy[1]:g}x of it has served a request to measure its watts"
        if (second := self.runner_up()) is not None:
            text += f" (runner-up {second[0]} {second[1].total:.3g} s)"
        left_alone = [name for name in self.admitted if name in self.idle]
        if self.fallback:
            text += ("; its engine is slower at every load than another on its cores, no other mode admitted and "
                     "measured")
        elif left_alone:
            text += ("; left alone, their engine slower at every load than another on its cores: "
                     + ", ".join(left_alone))
        return text + self.explain.tail()


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _mode_list(sec: Section, key: str, known: set[str], default=None) -> tuple[str, ...]:
    value = sec.get(key, (str, list), default) if default is not None else sec.get(key, (str, list))
    names = [value] if isinstance(value, str) else value
    if not names and key != "fallback":
        raise sec.error("must name at least one mode", key)
    for name in names:
        if not isinstance(name, str):
            raise sec.error(f"mode names must be strings, got {name!r}", key)
        if name not in known:
            raise sec.error(f"unknown mode {name!r} (modes: {', '.join(sorted(known))})", key)
    return tuple(names)


def parse_rules(sec: Section, known: set[str], common: dict[str, Any]) -> RulePolicy:
    """A ``type: rules`` policy; ``common``: the blocks every policy has (see ``policy.parse_common``)."""
    source = sec.source
    sec.only(COMMON_KEYS | {"rules", "default", "fallback", "order", "latency_slack", "explore"})
    rules = []
    raw_rules = sec.get("rules", list, [])
    for i, raw in enumerate(raw_rules):
        rsec = Section(raw, source, f"rules[{i}]")
        rsec.only({"name", "when", "use", "prefer", "energy", "order"})
        name = rsec.get("name", str, f"rule{i + 1}")
        conditions = []
        when = rsec.section("when", Section({}, source, f"rules[{i}].when"))
        for feature in when.data:
            if feature not in FEATURE_DOCS:
                raise when.error(f"unknown feature (features: {', '.join(FEATURE_DOCS)})", str(feature))
            csec = when.section(str(feature))
            csec.only(OPERATORS)
            if not csec.data:
                raise when.error("needs an operator such as {ge: 256}", str(feature))
            for op in csec.data:
                conditions.append(Condition(str(feature), str(op), float(csec.get(str(op), (int, float)))))
        energy = rsec.section("energy", None)
        cap = None
        if energy is not None:
            energy.only({"max_j_per_token"})
            cap = positive(energy, "max_j_per_token", None)
        rules.append(Rule(name, tuple(conditions), _mode_list(rsec, "use", known),
                          rsec.get("prefer", str, None, PREFER), cap, rsec.get("order", str, None, ORDERS)))
    return RulePolicy(
        rules=tuple(rules),
        default=_mode_list(sec, "default", known),
        fallback=_mode_list(sec, "fallback", known, []),
        order=sec.get("order", str, RulePolicy.order, ORDERS),
        latency_slack=_factor(sec, "latency_slack", RulePolicy.latency_slack),
        explore=_explore(sec),
        **common,
    )


def _explore(sec: Section) -> Explore | None:
    raw = sec.section("explore", None)
    if raw is None:
        return None
    raw.only({"within", "requests"})
    within = _factor(raw, "within")
    requests = raw.get("requests", int)
    if requests < 1:
        raise raw.error(f"must be at least 1, got {requests}", "requests")
    return Explore(within, requests)


def _factor(sec: Section, key: str, *default: float) -> float:
    """``key``: a factor of the fastest mode's predicted time (at least 1); required unless ``default`` is given."""
    value = float(sec.get(key, (int, float), *default))
    if value < 1:
        raise sec.error(f"must be at least 1 (a factor of the fastest mode's predicted time), got {value:g}", key)
    return value
