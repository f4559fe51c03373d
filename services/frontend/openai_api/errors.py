"""Errors as OpenAI's error object with the matching HTTP status, never a stack
trace: the domain errors' gRPC codes map to statuses, and request bodies that do
not validate are 400s naming the field."""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

import grpc
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request

from services.common.errors import InvalidArgument, LLMServeError
from services.frontend.openai_api.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type).
ERROR_STATUSES = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    # nginx's "client closed request": nobody reads it, the logs do.
    grpc.StatusCode.CANCELLED: (499, "client_closed_request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def http_status(error: LLMServeError) -> int:
    return ERROR_STATUSES.get(error.code, (500, ""))[0]


def error_body(error: LLMServeError) -> ErrorResponse:
    status, kind = ERROR_STATUSES.get(error.code, (500, "internal_error"))
    param = None
    if isinstance(error, InvalidArgument):  # "sampling_params.top_p" is "top_p" here
        param = error.field.removeprefix("sampling_params.")
    message = str(error).removeprefix("sampling_params.") if status != 500 \
        else "internal error; the server log has the details"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param,
                                         code=error.code.name.lower()))


def _response(status: int, body: ErrorResponse) -> JSONResponse:
    return JSONResponse(body.model_dump(), status_code=status)


async def _domain_error(request: Request, error: LLMServeError) -> JSONResponse:
    return _response(http_status(error), error_body(error))


async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    errors = error.errors()
    field = _field(errors[0]["loc"])
    # A union (e.g. prompt: text or token ids) fails once per accepted form.
    forms = [e for e in errors if _field(e["loc"]) == field]
    message = forms[0]["msg"] if len(forms) == 1 else \
        "matches none of its accepted forms (" + "; ".join(e["msg"] for e in forms[:4]) + ")"
    return _response(400, ErrorResponse(error=ErrorInfo(
        message=f"{field or 'body'}: {message}", type="invalid_request_error",
        param=field or None, code="invalid_argument")))


def _field(loc: tuple) -> str:
    """The request field an error is about: its path, without pydantic's "body"
    and its union-member tags (str, list[int], ...)."""
    return ".".join(str(part) for part in loc
                    if part != "body" and not (isinstance(part, str) and (
                        "[" in part or part in ("str", "int", "float", "bool", "dict", "list"))))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    return _response(error.status_code, ErrorResponse(error=ErrorInfo(
        message=str(error.detail), type="invalid_request_error")))


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s", request.url.path)
    return _response(500, ErrorResponse(error=ErrorInfo(
        message="internal error; the server log has the details", type="internal_error")))


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """on_error sees the HTTP status of every error response (to count them)."""
    def counted(handler: Callable[[Request, Exception], Awaitable[JSONResponse]]):
        async def respond(request: Request, error: Exception) -> JSONResponse:
            response = await handler(request, error)
            if on_error is not None:
                on_error(response.status_code)
            return response
        return respond

    app.add_exception_handler(LLMServeError, counted(_domain_error))
    app.add_exception_handler(RequestValidationError, counted(_invalid_body))
    app.add_exception_handler(HTTPException, counted(_http_error))
    app.add_exception_handler(Exception, counted(_unexpected))
