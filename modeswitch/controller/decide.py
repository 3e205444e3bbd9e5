"""The decision pipeline for one request: gates filter modes, the policy chooses, the reason is recorded;
and the one hook through which finished requests reach the policy and any other observer.

The controller holds the current policy behind one reference: a reload parses and validates the new
file completely first and swaps the reference only on success, so a broken file never replaces a
working policy and requests in progress keep the policy they started with.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..yamlconf import ConfigError
from .completed import Completed, Observer
from .costs import CostModel
from .features import Features
from .gates import Cycle, gates
from .load import load_policy
from .policy import Choice, Policy
from .quality import Judged, judge_mode, read_report
from .verdicts import Code, Verdict, most_hopeful
from .view import ModeView

log = logging.getLogger(__name__)

_NOT_LOADED = Verdict(Code.NOT_LOADED, "not loaded (--modes)")
_EXCLUDED = Verdict(Code.EXCLUDED, "excluded after a failed attempt")


class NoEligibleMode(RuntimeError):
    """Every mode the policy could use is filtered. ``code`` says why, and so whether waiting would help
    (``code.transient``); with several verdicts, the one :func:`most_hopeful` picks. ``saturated``: the modes
    found with their queues full (a request's own earlier prompts there free room as they finish)."""

    def __init__(self, message: str, code: Code, saturated: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.code, self.saturated = code, saturated


@dataclass(slots=True)
class Decision:
    """What :meth:`Controller.decide` decided for one request: read, not changed, after it is made (not frozen: a
    frozen dataclass's construction alone costs a decision more than a microsecond)."""

    mode: str
    #: why: the text, or what writes it when :attr:`reason` is first read (see :class:`~.policy.Choice`)
    why: str | Callable[[], str]
    features: Features
    filtered: Mapping[str, Verdict] = field(default_factory=dict)
    policy: str = ""
    #: what deciding cost: the deciding thread's CPU time (the work the decision does), and the wall time it took
    #: (that work plus any time the thread waited for a core or the interpreter lock other threads held)
    decision_us: float = 0.0
    #: the rule that matched, "default", "pinned", or "pinned-gate-pending" (a low-cardinality metrics label: the
    #: decisions counter counts the answers no quality verdict vouched for under it)
    rule: str = ""
    #: the policy's pick, with what it expected of the chosen mode (and of the runner-up); None: pinned, or a
    #: stand-in for a policy whose modes were all filtered
    chosen: Choice | None = None
    decision_wall_us: float = 0.0
    #: why the chosen mode's quality verdict was pending (pinned: its gate rows were scored on other kernels); empty
    #: when the gate had passed it
    gate_pending: str = ""
    _reason: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def reason(self) -> str:
        """:attr:`why`'s text, written on the first read."""
        if self._reason is None:
            self._reason = self.why if isinstance(self.why, str) else self.why()
        return self._reason

    @property
    def prediction(self) -> Mapping | None:
        return self.chosen.prediction if self.chosen is not None else None


def _explained(policy: str, choice: Choice) -> str:
    return f"policy {policy}: {choice.reason}"


class Controller:
    def __init__(self, modes: Mapping[str, ModeView], policy: Policy, kv_bytes_per_token: int = 0,
                 defined_modes: Sequence[str] = (), costs: CostModel | None = None,
                 standing: Callable[[], int] | None = None) -> None:
        """``modes``: the resident modes by name, read at every decision (the registry's live views).
        ``kv_bytes_per_token``: the model's KV size, for the memory gate's estimate of what a request needs.
        ``defined_modes``: every mode a policy may name, loaded or not (``--modes`` loads a subset).
        ``costs``: what each mode's engine measured, from which a policy may order modes by predicted time
        (default: an empty model, kept nowhere).
        ``standing``: a count that moves whenever a mode's standing changes (available, quarantine, engine, card:
        the registry's ``Standing``); with it the standing gates' verdicts are kept between decisions until it
        moves (a decision then asks only the gates that read the request), without it they are asked every time."""
        self.modes = modes
        self.policy = policy
        self.costs = costs if costs is not None else CostModel()
        self.quality_report: dict | None = None
        self.quality_report_path: Path | None = None
        #: a directory of gate runs this machine scored itself (see ``modeswitch.evals.behind``): the report of the
        #: same file name there is read with the report, its runs the newest
        self.quality_cache: Path | None = None
        self.gates = gates(kv_bytes_per_token)
        self._standing_gates = tuple(g for g in self.gates if g.standing)
        self._request_gates = tuple(g for g in self.gates if not g.standing)
        self._standing_count = standing
        #: the standing gates' verdicts: (the count, policy, report and task they were asked under, the modes they
        #: passed, the verdicts with the modes not loaded), replaced whole
        self._standing: tuple = ()
        self.defined_modes = tuple(dict.fromkeys([*defined_modes, *modes]))
        self._not_loaded = {m: _NOT_LOADED for m in self.defined_modes if m not in modes}
        self._observers: list[Observer] = []
        self._reload_lock = threading.Lock()
        self.rebind()

    def rebind(self) -> None:
        """Tell the policy which modes share a batch, as the modes stand now (again once the modes of a
        staged start have come up)."""
        self.policy.bind(self.batches(), self.batching(), self.drafting())

    def batches(self) -> dict[str, str]:
        """Each resident mode's running batch (what a policy may learn once for all the modes sharing it)."""
        return {name: mode.batch for name, mode in self.modes.items()}

    def batching(self) -> frozenset[str]:
        """The resident modes whose engine runs several requests in one batch."""
        return frozenset(name for name, mode in self.modes.items() if mode.batch_slots > 1)

    def drafting(self) -> frozenset[str]:
        """The resident modes that decode speculatively."""
        return frozenset(name for name, mode in self.modes.items() if mode.speculative)

    def filter(self, features: Features, exclude: frozenset[str] = frozenset()) -> dict[str, Verdict]:
        """Modes a gate rejects for this request, with the first gate's verdict."""
        return self._filter(Cycle(features, self.policy, self.quality_report), exclude)

    def _filter(self, cycle: Cycle, exclude: frozenset[str]) -> dict[str, Verdict]:
        if exclude:  # a retry: the standing gates asked afresh, without the modes that failed it
            left, filtered = self._ask_standing(cycle, exclude)
        else:
            left, standing = self._standing_verdicts(cycle)
            filtered = dict(standing)
        for gate in self._request_gates:
            left = gate.admit(left, cycle, filtered)
        return filtered

    def _ask_standing(self, cycle: Cycle, exclude: frozenset[str]) -> tuple[list[ModeView], dict[str, Verdict]]:
        """The modes not excluded that the standing gates pass, and the verdicts on the rest (with the modes not
        loaded and those excluded)."""
        filtered: dict[str, Verdict] = dict(self._not_loaded)
        filtered.update((name, _EXCLUDED) for name in exclude if name in self.modes)
        left = [mode for name, mode in self.modes.items() if name not in exclude]
        for gate in self._standing_gates:
            left = gate.admit(left, cycle, filtered)
        return left, filtered

    def _standing_verdicts(self, cycle: Cycle) -> tuple[list[ModeView], dict[str, Verdict]]:
        """:meth:`_ask_standing` with nothing excluded, kept from an earlier decision while the standing count, the
        policy, the report and the task are the ones they were asked under. Not kept while a mode is quarantined
        (its verdict ends with the clock, and says how soon)."""
        count = self._standing_count() if self._standing_count is not None else None
        kept = self._standing
        if (count is not None and kept and kept[0] == count and kept[1] is cycle.policy
                and kept[2] is cycle.quality_report and kept[3] == cycle.features.task):
            return kept[4], kept[5]
        left, filtered = self._ask_standing(cycle, frozenset())
        if count is not None and not any(v.code is Code.QUARANTINED for v in filtered.values()):
            self._standing = (count, cycle.policy, cycle.quality_report, cycle.features.task, left, filtered)
        return left, filtered

    def decide(self, features: Features, pinned: str | None = None, exclude: frozenset[str] = frozenset()) -> Decision:
        start, cpu = time.perf_counter(), time.thread_time_ns()
        cycle = Cycle(features, self.policy, self.quality_report)
        policy = cycle.policy
        filtered = self._filter(cycle, exclude)
        pending, chosen = "", None
        reason: str | Callable[[], str]
        if pinned is not None:
            refused = filtered.get(pinned)
            mode, reason, rule = pinned, "pinned by the request", "pinned"
            if refused is not None and refused.code is Code.GATE_PENDING:  # pinning is how a pending mode is served
                pending, reason, rule = refused.detail, f"pinned by the request; {refused.detail}", "pinned-gate-pending"
            elif refused is not None:
                raise NoEligibleMode(f"pinned mode {pinned!r} cannot serve this request: {refused}", refused.code,
                                     frozenset((pinned,)) if refused.code is Code.SATURATED else frozenset())
        else:
            choice = policy.choose(features, filtered, self.costs.predictor(features, features.draft_tokens_per_step),
                                   self._watts)
            if choice.mode is None and (stand_in := self._stand_in(policy, features, filtered)) is not None:
                mode, why, rule = stand_in
                reason = f"policy {policy.name}: {choice.reason}; {why}"
            elif choice.mode is None:
                raise NoEligibleMode(choice.reason, most_hopeful(v.code for v in filtered.values()),
                                     frozenset(m for m, v in filtered.items() if v.code is Code.SATURATED))
            else:
                mode, rule, chosen = choice.mode, choice.rule or "default", choice
                reason = partial(_explained, policy.name, choice)
        spent_us = (time.thread_time_ns() - cpu) / 1e3
        wall_us = (time.perf_counter() - start) * 1e6
        return Decision(mode, reason, features, filtered, policy.name, spent_us, rule, chosen, wall_us, pending)

    def _watts(self, mode: str) -> float | None:
        """A resident mode's running watts (None before its first request): what a policy ordering by energy prices
        a request's predicted time at."""
        view = self.modes.get(mode)
        return view.watts if view is not None else None

    def add_observer(self, observer: Observer) -> None:
        """Have ``observer`` called with every completed request."""
        self._observers.append(observer)

    def observe(self, completed: Completed) -> None:
        """A request finished, however it ended: every observer, then the policy, get the record (the
        policy last, so a learner that fails to save its state costs no observer its count)."""
        for observer in self._observers:
            observer(completed)
        self.policy.observe(completed)

    def close(self) -> None:
        """Persist what the policy has learned and the costs measured (server shutdown)."""
        self.policy.save()
        self.costs.save()

    def _stand_in(self, policy: Policy, features: Features,
                  filtered: Mapping[str, Verdict]) -> tuple[str, str, str] | None:
        """When the policy's own modes are all filtered, any mode that passed every gate rather than an error,
        in two cases: memory pressure (the memory gate lets only preallocated-KV modes through), and modes still
        loading after a staged start or with their quality verdict pending (the request gets an answer of a mode the
        gate passed rather than none). (mode, why, rule)."""
        spare = next((name for name in self.modes if name not in filtered), None)
        if spare is None:
            return None
        if features.memory_headroom < policy.memory.min_headroom:
            return spare, f"memory pressure: degraded to {spare} (its KV is reserved at start)", "memory-degrade"
        if any(v.code is Code.LOADING for v in filtered.values()):
            return spare, f"served by {spare} while those load", "while-loading"
        if any(v.code is Code.GATE_PENDING for v in filtered.values()):
            return spare, f"served by {spare} while their quality gate is pending", "while-gate-pending"
        return None

    def quality_verdicts(self, task: str = "general") -> dict[str, Judged] | None:
        """Per resident mode the gate report has a row for: its verdict under the current policy's tolerances for
        ``task`` on the kernels it serves on now; None when no report is loaded. What ``/v1/modes`` shows and a
        cluster replica publishes."""
        report = self.quality_report
        if report is None:
            return None
        judged = {name: judge_mode(report, self.policy.quality, task, name, mode.kernels)
                  for name, mode in self.modes.items()}
        return {name: j for name, j in judged.items() if j is not None}

    def load_quality_report(self, path: str | Path | None = None, read: dict | None = None) -> dict | None:
        """Read the gate report (default: the one loaded before) with the runs of its namesake in
        :attr:`quality_cache`; a missing or broken report changes nothing, a broken cached one is left out.
        ``read``: ``path``'s report as :func:`~.quality.read_report` already read it (the start reads it once)."""
        path = Path(path) if path else self.quality_report_path
        if path is None:
            raise ConfigError("no quality gate report configured (--gate-report)")
        report = read if read is not None else read_report(path, self.quality_cache)
        self.quality_report, self.quality_report_path = report, path
        return report

    def reload(self, path: str | Path | None = None) -> Policy:
        """Load ``path`` (default: the current policy's file) and switch to it; on any error keep the old one."""
        with self._reload_lock:
            self.close()  # a learning policy's state is saved first, so reloading its own file keeps what it learned
            new = load_policy(path or self.policy.source, self.defined_modes)
            new.bind(self.batches(), self.batching(), self.drafting())
            self.policy = new
            return new
