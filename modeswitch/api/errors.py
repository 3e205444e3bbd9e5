"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from flask import jsonify

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
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
