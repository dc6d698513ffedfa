"""The server's errors, answered in OpenAI's shape or, on Anthropic's routes, in Anthropic's."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ANTHROPIC_PREFIX = "/v1/messages"

# OpenAI's error types by status (others: server_error from 500, else invalid_request_error).
OPENAI_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
}

# Anthropic's error types by status.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
}

# The `code` of an error starlette raises (unknown route, wrong method, body too large).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def anthropic_error_body(status: int, message: str) -> dict:
    """An error as Anthropic answers it."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_ERROR_TYPES.get(status, default)
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        default = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or OPENAI_ERROR_TYPES.get(status, default)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, path: str = "") -> JSONResponse:
        """The error as JSON; in Anthropic's shape on its routes (`/v1/messages...`)."""
        if path.startswith(ANTHROPIC_PREFIX):
            body = anthropic_error_body(self.status, self.message)
            return JSONResponse(body, status_code=self.status)
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(exc: RequestValidationError) -> APIError:
    """A request that fails its schema, as a 400 naming the first field at fault."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app meets answered as an `APIError`."""

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        code = HTTP_CODES.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), code=code)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}").response(request.url.path)
