"""An error as every layer raises it: its HTTP status, message, code and the request field at
fault, and its body in OpenAI's shape. The HTTP edge (server/http/errors.py) answers it in the
shape of the API a route serves; nothing here knows HTTP frameworks, so the service raises it
too."""
from __future__ import annotations

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          408: "timeout_error", 413: "invalid_request_error", 422: "invalid_request_error",
          431: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error",
          503: "service_unavailable", 507: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def printable(text: str) -> str:
    """Text that can be encoded as UTF-8: lone surrogates (from a client's JSON) become U+FFFD,
    so an error message that quotes client input can always be sent."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": printable(message),
                      "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else printable(param), "code": code}}
