"""OpenAI-style error envelopes, and the FastAPI handlers that make every failure one."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable", 504: "timeout_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = status, message, param, code, retry_after_s

    def body(self) -> dict:
        return envelope(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def envelope(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}


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
    async def _openai(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):  # last resort: never a plain-text 500
        return OpenAIError(500, f"internal error ({type(exc).__name__})").response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = describe_validation_error(exc)
        return OpenAIError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = "route not found" if exc.status_code == 404 else str(exc.detail)
        return OpenAIError(exc.status_code, message).response()
