"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from flask import jsonify

from ..controller.verdicts import Code

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        resp = jsonify(self.body())
        resp.status_code = self.status
        if self.retry_after is not None:
            resp.headers["Retry-After"] = str(self.retry_after)
        return resp


RETRY_AFTER_S = 1

#: The error code of a 503 by why no mode could take the request (the controller's verdict codes); any
#: other code answers ``no_eligible_mode``. Every 503 says when to retry.
NO_MODE_CODES = {Code.SATURATED: "overloaded", Code.QUARANTINED: "mode_quarantined", Code.MEMORY: "insufficient_memory",
                 Code.LOADING: "mode_loading"}


def no_eligible_mode(exc, pinned: bool) -> ApiError:
    """The answer to a :class:`~modeswitch.controller.decide.NoEligibleMode`: a pinned mode refused for a
    reason waiting cannot cure (unavailable here, not capable, failing a gate) is the request's fault, 400, and
    so is a request no resident mode can honour (a grammar where no engine constrains); anything else is 503
    with Retry-After."""
    if pinned and not exc.code.transient:
        return ApiError(400, str(exc), param="mode", code="mode_unavailable")
    if exc.code == Code.CAPABILITY:
        return ApiError(400, f"no mode of this server can serve the request: {exc}", code="unsupported_option")
    return ApiError(503, str(exc), code=NO_MODE_CODES.get(exc.code, "no_eligible_mode"), retry_after=RETRY_AFTER_S)
