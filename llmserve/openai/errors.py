"""Errors in OpenAI's JSON shape with their HTTP status: the one place every path builds them."""

from __future__ import annotations

import json

from llmserve.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    409: "ConflictError",
    413: "RequestTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


# the `code` of an error that names none: a string always, as OpenAI's codes are
_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "unprocessable_entity",
    429: "rate_limit_exceeded",
    431: "headers_too_large",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def default_code(status: int) -> str:
    """The error code of a status, when the error names none."""
    return _CODES.get(status) or ("internal_error" if status >= 500 else "invalid_request")


class APIError(Exception):
    """An error a client should see, with its HTTP status."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    info = ErrorInfo(message=message, type=kind, param=param, code=code if code is not None else default_code(status))
    return ErrorResponse(error=info).model_dump()


def engine_dead(reason: object = None) -> APIError:
    """The 503 of a request that meets a dead engine core (whole replies; streams end with an event)."""
    return APIError(
        503, "the engine is not running" + (f": {reason}" if reason is not None else ""), code="engine_dead"
    )


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """An error inside a stream: sent as a final SSE event."""
    return f"data: {json.dumps(error_body(status, message, code))}\n\n"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A request's schema errors (pydantic's `errors()`) as one message, and the first field."""
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts), param
