"""Domain errors, and the one interceptor that turns them into gRPC status codes."""
from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

logger = logging.getLogger(__name__)


class LLMServeError(Exception):
    """An error a caller can act on; `code` is the gRPC status it becomes."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(LLMServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unauthenticated(LLMServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(LLMServeError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LLMServeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LLMServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LLMServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


def request_id_in_use(request_id: str) -> AlreadyExists:
    """The error for a new request whose id a running request holds."""
    return AlreadyExists(f"request_id {request_id!r} is still running; use another id")


class Cancelled(LLMServeError):
    """The caller went away (its request was aborted)."""

    code = grpc.StatusCode.CANCELLED


class Unavailable(LLMServeError):
    code = grpc.StatusCode.UNAVAILABLE


def from_rpc_error(error: grpc.RpcError) -> LLMServeError:
    """A remote service's status, re-raised as ours so it passes through unchanged."""
    return error_with_status(error.code(), error.details())


def error_with_status(code: grpc.StatusCode, message: str) -> LLMServeError:
    mapped = LLMServeError(message or str(code))
    mapped.code = code
    return mapped


def status_number(code: grpc.StatusCode) -> int:
    """google.rpc.Code's number for a status (INVALID_ARGUMENT: 3)."""
    return code.value[0]


def status_from_number(number: int) -> grpc.StatusCode:
    return _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Aborts the RPC with the status of any LLMServeError its handler raises, or
    INTERNAL for any other exception (and tells on_error, which counts them). It
    also parses requests itself: a message that is not valid protobuf (bad UTF-8
    in a string, say) is then INVALID_ARGUMENT, where grpc's own parsing would
    answer INTERNAL."""

    def __init__(self, on_error: Callable[[grpc.StatusCode], None] | None = None):
        self.on_error = on_error or (lambda code: None)

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        parse = handler.request_deserializer or (lambda raw: raw)
        end = functools.partial(_end_with_status, handler_call_details.method, self.on_error)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, parse, end), None, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, parse, end), None, handler.response_serializer)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_bidi(handler.stream_stream, parse, end), None, handler.response_serializer)
        return handler  # stream-unary: no service has one


def _parse(parse: Callable[[bytes], Any], raw: bytes) -> Any:
    try:
        return parse(raw)
    except Exception as e:  # protobuf's DecodeError, and whatever a parser raises
        raise InvalidArgument("request", f"is not a valid message: {e}") from None


# Ends a call of one method with an exception's status (see _end_with_status).
_End = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]


async def _end_with_status(method: str, on_error: Callable[[grpc.StatusCode], None],
                           e: Exception, context: grpc.aio.ServicerContext) -> None:
    """Ends the call with e's status: an LLMServeError's, a failed downstream call's
    own; anything else is a bug, INTERNAL, logged with its traceback (gRPC alone
    would answer UNKNOWN and log nothing, and no metric would count it)."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        e = from_rpc_error(e)
    if isinstance(e, LLMServeError):
        code, message = e.code, str(e)
    else:
        logger.error("internal error in %s", method, exc_info=e)
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
    on_error(code)
    await context.abort(code, message)


def _wrap_unary(behavior, parse: Callable[[bytes], Any], end: _End):
    async def wrapper(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return await behavior(_parse(parse, raw), context)
        except grpc.aio.AbortError:
            raise  # the call already ended with a status the handler chose
        except Exception as e:
            await end(e, context)

    return wrapper


def _wrap_stream(behavior, parse: Callable[[bytes], Any], end: _End):
    async def wrapper(raw: bytes, context: grpc.aio.ServicerContext):
        async for response in _responses_or_abort(
                lambda: behavior(_parse(parse, raw), context), context, end):
            yield response

    return wrapper


def _wrap_bidi(behavior, parse: Callable[[bytes], Any], end: _End):
    """Each request is parsed as the handler reads it: a bad one ends the call
    with INVALID_ARGUMENT, raised where the handler reads."""
    async def wrapper(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def requests():
            async for raw in raw_requests:
                yield _parse(parse, raw)

        async for response in _responses_or_abort(
                lambda: behavior(requests(), context), context, end):
            yield response

    return wrapper


async def _responses_or_abort(responses: Callable[[], AsyncIterator[Any]],
                              context: grpc.aio.ServicerContext, end: _End):
    try:
        async for response in responses():
            yield response
    except grpc.aio.AbortError:
        raise
    except Exception as e:
        await end(e, context)
