"""OpenAI-style error envelopes (Anthropic's on its Messages routes), and the FastAPI handlers that make every failure
one."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable", 504: "timeout_error"}
# Anthropic's error types by status; its Messages routes answer in its envelope, which its clients read
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
ANTHROPIC_ROUTES = "/v1/messages"


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = status, message, param, code, retry_after_s

    def body(self) -> dict:
        return envelope(self.status, self.message, self.param, self.code)

    def response(self, scope: Scope | None = None) -> JSONResponse:
        """The error as the route that `scope` asked for answers: Anthropic's envelope on its Messages routes."""
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        anthropic = scope is not None and speaks_anthropic(scope)
        body = anthropic_envelope(self.status, self.message) if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


def envelope(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


def anthropic_envelope(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def as_anthropic(body: dict) -> dict:
    """An OpenAI envelope (a stream's in-band error) in Anthropic's."""
    status = next((s for s, kind in ERROR_TYPES.items() if kind == body["error"]["type"]), 500)
    return anthropic_envelope(status, body["error"]["message"])


def route_path(scope: Scope) -> str:
    """The path as the app's routes see it. Under a Serve route_prefix the ASGI path still carries the prefix
    (it is in root_path too), so a check on the raw path would miss every route of a prefixed app."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def speaks_anthropic(scope: Scope) -> bool:
    path = route_path(scope)
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


def describe_validation_error(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    path = (first.get("ctx") or {}).get("path")  # a validator's own, finer than the location it ran at
    param = path if path and path.startswith(".".join(location)) else ".".join(location) or path
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not location and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError):
        return exc.response(request.scope)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # last resort: never a plain-text 500
        return OpenAIError(500, f"internal error ({type(exc).__name__})").response(request.scope)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = describe_validation_error(exc)
        return OpenAIError(400, message, param).response(request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return OpenAIError(exc.status_code, message).response(request.scope)
