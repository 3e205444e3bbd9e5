"""One ModeSwitch server inside a cluster replica.

:class:`ReplicaServer` is the single server (built by the composition root, with its own controller) that
answers forwarded HTTP requests by running its Flask app on them in-process, and reports what the cluster
router needs. :class:`Replica` is the Ray Serve deployment around it.

Why the Flask app and not a second (ASGI) implementation of the API: every route, validation rule, error
shape and SSE frame stays exactly the single server's, tested once; a request costs one in-process WSGI call
(microseconds) on top of the model's work.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator

from ray import serve
from werkzeug.test import EnvironBuilder, run_wsgi_app

from .. import logs
from ..compose import build_app
from ..config import ServerConfig
from ..device import memory_headroom
from ..evals.behind import score_behind
from ..serving.occupancy import occupancy
from .prefixes import PrefixLog
from .wire import TOKEN_IDS, Answer, Forwarded

log = logging.getLogger("modeswitch.cluster")


class ReplicaServer:
    """The single server under a replica name; thread-safe (Serve calls it from a thread pool)."""

    def __init__(self, config: ServerConfig, name: str, backend=None) -> None:
        self.name = name
        config = dataclasses.replace(config, http=dataclasses.replace(config.http, replica=name))
        self.server = build_app(config, backend=backend)
        self._prefixes = PrefixLog(self.server.service.registry.prefix_capacity_tokens())
        self._lock = threading.Lock()
        #: scores the modes the gate has no verdict for on these kernels, between the requests forwarded here
        self.scorer = score_behind(self.server)

    def _prompt_tokens(self, text: str) -> int:
        """Tokens of a routing text: counted for token ids (``"17|4|"``), else the tokenizer's count."""
        if TOKEN_IDS.fullmatch(text):
            return text.count("|")
        return len(self.server.service.tokenizer.encode(text, add_special_tokens=False))

    def _run(self, req: Forwarded):
        if req.prompt and self._prefixes.capacity_tokens:
            tokens = self._prompt_tokens(req.prompt)
            with self._lock:
                self._prefixes.record(req.prompt, tokens)
        environ = EnvironBuilder(path=req.path, method=req.method, query_string=req.query or None,
                                 headers=req.headers, data=req.body,
                                 environ_base={"REMOTE_ADDR": req.client}).get_environ()
        return run_wsgi_app(self.server.app, environ, buffered=False)

    def answer(self, req: Forwarded) -> Answer:
        body, status, headers = self._run(req)
        try:
            data = b"".join(body)
        finally:
            getattr(body, "close", lambda: None)()
        return Answer(int(status.split()[0]), list(headers.items()), data)

    def stream(self, req: Forwarded) -> Iterator[Answer | bytes]:
        """The response head (an :class:`Answer` whose body is the first frame) and then the body as it is
        produced.

        The first SSE frame (the role, the mode and its reason) is written before the model has done any
        work; it is held back until the next frame exists, so the head reaches the ingress only once the
        first token does. Until then nothing has gone to the client and the ingress can still send the
        request to another replica if this one dies: that covers queueing and prefill, most of a request's
        exposure."""
        body, status, headers = self._run(req)
        try:
            chunks = (c for c in body if c)
            first = next(chunks, b"")
            second = next(chunks, b"") if (headers.get("Content-Type") or "").startswith("text/event-stream") else b""
            yield Answer(int(status.split()[0]), list(headers.items()), first + second)
            yield from chunks
        finally:  # also when the ingress stops reading (client gone): the generation is cancelled
            getattr(body, "close", lambda: None)()

    def routing_stats(self) -> dict:
        """What the cluster router scores this replica by (published every stats period)."""
        service = self.server.service
        available = [m.name for m in service.registry.available()]
        verdicts = service.controller.quality_verdicts()
        if verdicts is not None:
            available = [m for m in available if m not in verdicts or verdicts[m].status == "pass"]
        load = occupancy(service.registry)
        rates = [s.j_per_token for s in service.registry.modes.values()
                 if s.j_per_token is not None and s.name in available]
        with self._lock:
            blocks = self._prefixes.summary()
        return {"replica": self.name, "modes": available, "waiting": load.waiting, "running": load.running,
                "kv_cache_usage": load.kv_cache_usage, "headroom": memory_headroom()[1],
                "j_per_token": min(rates) if rates else None, "prefix_blocks": blocks}

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.stop()
        self.server.close()


@serve.deployment(name="modeswitch-replica", health_check_period_s=2, health_check_timeout_s=30)
class Replica:
    """A Serve replica owning one :class:`ReplicaServer`, named by Serve's replica id."""

    def __init__(self, config: ServerConfig, backend=None) -> None:
        name = serve.get_replica_context().replica_id.unique_id
        logs.configure(config.log_level, config.verbose)
        self.core = ReplicaServer(config, name, backend=backend)
        log.info("replica %s ready", name)

    def answer(self, req: Forwarded) -> Answer:
        return self.core.answer(req)

    def stream(self, req: Forwarded):
        yield from self.core.stream(req)

    def record_routing_stats(self) -> dict:
        return self.core.routing_stats()

    def check_health(self) -> None:
        if not self.core.server.service.registry.available():
            raise RuntimeError("no mode available")

    def __del__(self) -> None:
        core = getattr(self, "core", None)
        if core is not None:
            core.close()
