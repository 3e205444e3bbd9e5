"""The HTTP app: blueprints for completions, chat, admin and operations, with authentication and
OpenAI-style errors applied to all of them."""

from __future__ import annotations

import hmac
import logging

from flask import Flask, request
from werkzeug.exceptions import HTTPException

from . import admin, chat, completions, ops
from .context import EXTENSION, ApiContext
from .errors import ApiError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20


def create_app(context: ApiContext) -> Flask:
    """The app serving ``context``; with ``context.http.api_key`` every route but /health needs it as a
    bearer token."""
    app = Flask("modeswitch")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False
    app.extensions[EXTENSION] = context
    api_key = context.http.api_key

    @app.before_request
    def _authenticate():
        if not api_key or request.path == "/health":
            return None
        given = request.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())):
            return ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                            code="invalid_api_key").response()
        return None

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError):
        if exc.status in (429, 503):
            context.service.metrics.rejected.labels(exc.code or str(exc.status)).inc()
        return exc.response()

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        message = {404: "no such route", 405: "method not allowed", 413: f"request body over {MAX_BODY_BYTES} bytes"}
        resp = ApiError(exc.code or 500, message.get(exc.code, exc.description or exc.name)).response()
        allow = dict(exc.get_headers()).get("Allow")
        if allow:  # 405 must say which methods the route has
            resp.headers["Allow"] = allow
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {exc.__class__.__name__}").response()

    for module in (completions, chat, admin, ops):
        app.register_blueprint(module.bp)
    return app
