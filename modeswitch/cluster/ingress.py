"""The cluster's HTTP front: a Serve ingress that forwards each request to one replica, chosen by the request
router, and merges the per-replica views (``/v1/modes``, ``/metrics``).

It reads nothing of a request but the routing text (:func:`~modeswitch.cluster.wire.routing_text`); each
replica answers with the single server's own API. Faults: a generation whose replica dies before answering
(or, streamed, before its first token) is sent once more to another replica; after that, or when no replica
is up, the client gets a 503 with ``Retry-After``; a stream cut after its first token ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.context import _set_request_context

from ..api.errors import ApiError
from . import directory
from .wire import GENERATION_PATHS, Answer, Forwarded, routing_text

log = logging.getLogger("modeswitch.cluster")

#: a replica that died or became unreachable: the request never got an answer from it
REPLICA_LOST = (RayActorError, ActorUnavailableError)
#: a replica's response headers that describe its own framing, not the ingress's (Starlette sets them anew)
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}
#: how long to wait for one replica's /v1/modes or /metrics
FAN_OUT_TIMEOUT_S = 10.0
RETRY_AFTER_S = 5

api = FastAPI(title="ModeSwitch cluster", docs_url=None, redoc_url=None, openapi_url=None)


def error(status: int, message: str, code: str, retry: bool = False) -> JSONResponse:
    """The single server's OpenAI-style error body (:class:`~modeswitch.api.errors.ApiError`), from Starlette."""
    return JSONResponse(ApiError(status, message, code=code).body(), status_code=status,
                        headers={"Retry-After": str(RETRY_AFTER_S)} if retry else None)


def response_of(answer: Answer) -> Response:
    headers = {k: v for k, v in answer.headers if k.lower() not in HOP_BY_HOP}
    return Response(content=answer.body, status_code=answer.status, headers=headers)


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?(\s.*)$")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of several replicas as one exposition: every sample gains a ``replica`` label, and each
    family's samples stay together under one HELP/TYPE header (the format requires it)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                header, _ = families.setdefault(family, ([], []))
                if line not in header:
                    header.append(line)
                continue
            match = _SAMPLE.match(line)
            if not match or family is None:
                continue
            name, labels, rest = match.groups()
            labels = f'replica="{replica}"' + (f",{labels}" if labels else "")
            families[family][1].append(f"{name}{{{labels}}}{rest}")
    return "".join("\n".join(header + samples) + "\n" for header, samples in families.values())


@serve.deployment(name="modeswitch-ingress", num_replicas=1, max_ongoing_requests=1024,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Ingress:
    """Bound to the replica deployment's handle; ``request_timeout_s``: how long a request may wait for its
    replica's first byte before a 503."""

    def __init__(self, replicas, request_timeout_s: float) -> None:
        self.replicas = replicas
        self.request_timeout_s = request_timeout_s

    # ------------------------------------------------------------ fan-out routes
    async def _replica_names(self) -> list[str]:
        """The replicas up now. The router (and so the directory) is built on a handle's first call."""
        if not directory.DIRECTORY.attached:
            await self._call(Forwarded("GET", "/health"), "answer")
            for _ in range(50):
                if directory.DIRECTORY.replicas():
                    break
                await asyncio.sleep(0.1)
        return sorted(directory.DIRECTORY.replicas())

    async def _each(self, request: Request, path: str, body: bytes = b"") -> dict[str, Answer | Exception]:
        """``request`` (its method, headers and ``body``) sent to every replica at ``path``."""
        names = await self._replica_names()
        headers = list(request.headers.items())

        async def ask(name: str) -> Answer:
            # Serve keys a handle call by the HTTP request it is made in, and its router keeps one pending call
            # per key: concurrent calls from one request would leave all but one unassigned. Each call runs in
            # a task of its own (gather), so it can be a request of its own.
            _set_request_context(_internal_request_id=uuid.uuid4().hex)
            return await self._call(Forwarded(request.method, path, request.url.query, headers, body,
                                              replica=name), "answer")

        calls = [asyncio.wait_for(ask(n), FAN_OUT_TIMEOUT_S) for n in names]
        return dict(zip(names, await asyncio.gather(*calls, return_exceptions=True)))

    @api.get("/health")
    async def health(self):
        """Up while at least one replica is (a load balancer in front of several ingresses reads this)."""
        names = await self._replica_names()
        if not names:
            return error(503, "no replica is up", "no_replica", retry=True)
        return {"status": "ok", "replicas": len(names)}

    @api.get("/v1/modes")
    async def modes(self, request: Request):
        """Every replica with its own ``/v1/modes`` (modes, gates, memory), or why it did not answer."""
        out = []
        for name, got in (await self._each(request, "/v1/modes")).items():
            if isinstance(got, Answer) and got.status == 401:
                return response_of(got)
            if isinstance(got, Answer) and got.status == 200:
                out.append({"replica": name, **json.loads(got.body)})
            else:
                out.append({"replica": name, "error": f"{got.__class__.__name__}: {got}"[:300]
                            if isinstance(got, Exception) else f"HTTP {got.status}"})
        if not out:
            return error(503, "no replica is up", "no_replica", retry=True)
        return {"object": "list", "replicas": out}

    @api.get("/metrics")
    async def metrics(self, request: Request):
        """Each replica's metrics, labelled ``replica``; a replica that does not answer is left out."""
        got = await self._each(request, "/metrics")
        denied = [a for a in got.values() if isinstance(a, Answer) and a.status == 401]
        if denied:
            return response_of(denied[0])
        texts = {n: a.body.decode() for n, a in got.items() if isinstance(a, Answer) and a.status == 200}
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.api_route("/admin/{path:path}", methods=["GET", "POST"])
    async def admin(self, path: str, request: Request):
        """Policy and gate changes go to every replica (each has its own controller), so the cluster never
        serves under two policies; the answer lists each replica's, and is the first failure's status if any
        replica refused."""
        got = await self._each(request, "/admin/" + path, await request.body())
        out, status = [], 200
        for name, a in got.items():
            if isinstance(a, Answer):
                out.append({"replica": name, "status": a.status, **json.loads(a.body or b"{}")})
                status = a.status if status == 200 else status
            else:
                out.append({"replica": name, "status": 503, "error": f"{a.__class__.__name__}: {a}"[:300]})
                status = 503 if status == 200 else status
        if not out:
            return error(503, "no replica is up", "no_replica", retry=True)
        return JSONResponse({"replicas": out}, status_code=status)

    # ------------------------------------------------------------ everything else: one replica
    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        prompt, stream = routing_text("/" + path, body)
        req = Forwarded(request.method, "/" + path, request.url.query, list(request.headers.items()), body,
                        request.client.host if request.client else "unknown", prompt, stream)
        if directory.DIRECTORY.attached and not directory.DIRECTORY.replicas():
            return error(503, "no replica is up; retry shortly", "no_replica", retry=True)
        retries = 1 if req.path in GENERATION_PATHS else 0
        try:
            if stream:
                return await asyncio.wait_for(self._stream(req, retries), self.request_timeout_s)
            return response_of(await asyncio.wait_for(self._answer(req, retries), self.request_timeout_s))
        except REPLICA_LOST as exc:
            log.warning("%s %s: replica lost, not retried further: %s", req.method, req.path, exc)
            return error(503, "the replica serving this request failed; retry", "replica_lost", retry=True)
        except asyncio.TimeoutError:
            return error(503, f"no replica answered within {self.request_timeout_s:.0f} s", "timeout", retry=True)

    # ------------------------------------------------------------ calls into the replica deployment
    def _call(self, req: Forwarded, method: str, stream: bool = False):
        return self.replicas.options(method_name=method, stream=stream).remote(req)

    async def _answer(self, req: Forwarded, retries: int) -> Answer:
        for attempt in range(retries + 1):
            try:
                return await self._call(req, "answer")
            except REPLICA_LOST as exc:
                if attempt == retries:
                    raise
                log.warning("%s: replica lost (%s); retrying on another", req.path, exc.__class__.__name__)
        raise AssertionError("unreachable")

    async def _stream(self, req: Forwarded, retries: int) -> Response:
        for attempt in range(retries + 1):
            chunks = self._call(req, "stream", stream=True)
            try:
                head: Answer = await chunks.__anext__()
                break
            except REPLICA_LOST as exc:
                chunks.cancel()
                if attempt == retries:
                    raise
                log.warning("%s: replica lost before the first token (%s); retrying", req.path, exc.__class__.__name__)

        async def body():
            try:
                if head.body:
                    yield head.body
                async for chunk in chunks:
                    yield chunk
            except REPLICA_LOST as exc:
                log.warning("%s: replica lost mid-stream: %s", req.path, exc.__class__.__name__)
                frame = ApiError(500, "the replica serving this stream failed", code="replica_lost").body()
                yield f"data: {json.dumps(frame)}\n\ndata: [DONE]\n\n".encode()
            finally:  # the client left, or the stream ended: stop the replica's generation too
                chunks.cancel()

        headers = {k: v for k, v in head.headers if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(body(), status_code=head.status, headers=headers)
