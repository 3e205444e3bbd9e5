"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from flask import jsonify

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

#: Why no mode could take a request -> (HTTP status, error code). Transient reasons (waiting helps) answer
#: 503 with Retry-After; anything else is 503 without it, or 400 when the request pinned that mode.
NO_MODE_STATUS = {
    "saturated": (503, "overloaded"),
    "quarantined": (503, "mode_quarantined"),
    "memory": (503, "insufficient_memory"),
    "unavailable": (503, "no_eligible_mode"),
}


def no_eligible_mode(exc, pinned: bool) -> ApiError:
    """The answer to a :class:`~modeswitch.controller.decide.NoEligibleMode`, from the table above."""
    if pinned and exc.code == "unavailable":
        return ApiError(400, str(exc), param="mode", code="mode_unavailable")
    status, code = NO_MODE_STATUS[exc.code]
    return ApiError(status, str(exc), code=code, retry_after=RETRY_AFTER_S)
