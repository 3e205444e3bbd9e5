"""One vLLM engine as the backend serves it: the runner it runs on now, its modes' fronts and their cards.

The runner changes under the fronts twice over: compiled behind the requests (``.start``), and started again
after a death (:mod:`..supervision`, which watches a :class:`ServedEngine` as one engine: every mode on it goes
down and comes back together).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ...engines.vllm.engine import VllmFront, VllmRunner
from .start import launch


class ServedEngine:
    """An engine key's runner, fronts and cards; what the supervisor watches (:class:`..supervision.Supervised`)."""

    def __init__(self, key: str, runner: VllmRunner, modes: list[str], closing: threading.Event,
                 compile_behind: Callable[["ServedEngine"], None] | None = None) -> None:
        """``closing``: set when the server stops (an engine that comes up after it is stopped at once).
        ``compile_behind(served)``: starts it again compiled behind the requests (``.start``), after it came back
        eager from a death; given where the server compiles its engines (None: it comes back as it was)."""
        self.key = key
        self.label = f"vLLM engine {key}"
        self.runner = runner
        #: the modes planned onto it
        self.modes = modes
        self.fronts: list[VllmFront] = []
        #: each mode's card: its decode path changes once the engine is compiled behind
        self.cards: list[dict[str, Any]] = []
        self._closing = closing
        #: the runner :meth:`fault` found dead: the one abandoned and started again, should the runner have been
        #: swapped (compiled behind) meanwhile
        self._dead = runner
        self._compile_behind = compile_behind

    def add(self, front: VllmFront, card: dict[str, Any]) -> None:
        self.fronts.append(front)
        self.cards.append(card)

    def serve_from(self, runner: VllmRunner) -> None:
        """Send its modes' new requests to ``runner`` (those already on the old one finish there)."""
        self.runner = runner
        for front in self.fronts:
            front.serve_from(runner)
        for card in self.cards:
            card["decode"] = decode(runner)

    # ------------------------------------------------------------------ what the supervisor asks
    def fault(self, stall_s: float) -> str | None:
        """Dead: one of its processes exited (killed, crashed, out of memory); vLLM's own client then waits on the
        dead process for good, which left the requests on it unanswered. Or wedged: a step that has run past
        ``stall_s``; it is killed (a wedged engine answers nothing else), and then handled as a dead one."""
        runner = self.runner
        why = runner.death()
        if why is None and (why := runner.stalled(stall_s)) is not None:
            runner.kill()
        if why is None:
            return None
        self._dead = runner
        return f"{self.label} died: {why}"

    def abandon(self, reason: str) -> None:
        self._dead.abandon(reason)

    def resume(self) -> bool:
        """Start it again with the dead runner's arguments (at the normal policy: its modes wait for it). Where the
        server compiles its engines it comes back eager, then is compiled again behind the requests: on a CPU,
        loading the compiled graphs from Inductor's cache and warming them up is most of a compiled restart (about
        21 of 26 s here). Whether the runner that died was still eager (its compile behind not done) or not."""
        args = self._dead.engine_args
        if self._compile_behind is not None:
            args = {**args, "enforce_eager": True}
        runner = launch(self.key, args)
        if self._closing.is_set():  # the server stopped while it started
            runner.close()
            return False
        self.serve_from(runner)
        if self._compile_behind is not None:
            self._compile_behind(self)
        return True

    def report_health(self, down: str | None, restarting: bool = False) -> None:
        for front in self.fronts:
            front.report_health(down, restarting)


def decode(runner: VllmRunner) -> str:
    """A mode's decode path on ``runner``, as its card says."""
    return "eager" if runner.engine_args["enforce_eager"] else "compiled"
