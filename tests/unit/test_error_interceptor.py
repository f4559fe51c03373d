"""ErrorMappingInterceptor over a real grpc.aio server, for each kind of handler
the services have (unary, server-streaming, bidirectional): an LLMServeError
ends the call with its status and message and is counted; bytes that are not a
valid request are INVALID_ARGUMENT; the calls beside a failed one are served."""
from contextlib import contextmanager

import grpc
import pytest

from services.common.errors import ErrorMappingInterceptor, NotFound, ResourceExhausted
from services.common.pb import worker_pb2
from tests.unit.aio_server_thread import aio_server_thread

Request = worker_pb2.AddLoraRequest  # any message with a number and a string


class _DownstreamError(grpc.RpcError):
    """What a failed call to another service raises (grpc.aio.AioRpcError's interface)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the worker is gone"


async def unary(request, context):
    if request.lora_id == 0:
        raise NotFound("adapter 0 is not loaded")
    if request.lora_id == 500:
        raise KeyError("a bug")
    if request.lora_id == 503:
        raise _DownstreamError()
    return request


async def server_stream(request, context):
    for _ in range(2):
        yield request
    raise ResourceExhausted("2 responses are the most this stream gives")


async def bidi(requests, context):
    async for request in requests:
        if request.lora_id == 13:
            raise ResourceExhausted("lora_id 13 is one too many")
        yield request


@contextmanager
def served():
    """(address, the status codes on_error saw)."""
    codes: list[grpc.StatusCode] = []
    serialize, parse = Request.SerializeToString, Request.FromString
    handlers = grpc.method_handlers_generic_handler("t.T", {
        "U": grpc.unary_unary_rpc_method_handler(unary, parse, serialize),
        "S": grpc.unary_stream_rpc_method_handler(server_stream, parse, serialize),
        "B": grpc.stream_stream_rpc_method_handler(bidi, parse, serialize)})
    with aio_server_thread(lambda server: server.add_generic_rpc_handlers([handlers]),
                           [ErrorMappingInterceptor(codes.append)]) as (address, _):
        yield address, codes


def status_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def test_each_kind_of_handler_ends_with_its_errors_status_and_counts_it():
    with served() as (address, codes), grpc.insecure_channel(address) as channel:
        raw = {name: kind(f"/t.T/{name}", Request.SerializeToString, Request.FromString)
               for name, kind in (("U", channel.unary_unary), ("S", channel.unary_stream),
                                  ("B", channel.stream_stream))}
        assert raw["U"](Request(lora_id=1), timeout=10).lora_id == 1
        e = status_of(lambda: raw["U"](Request(lora_id=0), timeout=10))
        assert (e.code(), e.details()) == (grpc.StatusCode.NOT_FOUND,
                                           "adapter 0 is not loaded")
        streamed = []
        e = status_of(lambda: streamed.extend(raw["S"](Request(lora_id=5), timeout=10)))
        assert [r.lora_id for r in streamed] == [5, 5]  # what came before the error
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        echoed = []
        e = status_of(lambda: echoed.extend(raw["B"](
            iter([Request(lora_id=i) for i in (1, 2, 13, 14)]), timeout=10)))
        assert [r.lora_id for r in echoed] == [1, 2]
        assert (e.code(), e.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "lora_id 13 is one too many")
        assert codes == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         grpc.StatusCode.RESOURCE_EXHAUSTED]


@pytest.mark.parametrize("kind", ["unary_unary", "unary_stream", "stream_stream"])
def test_bytes_that_are_not_a_request_are_invalid_argument(kind):
    bad = b"\xff\xff"  # a field tag with no end: not any message
    with served() as (address, codes), grpc.insecure_channel(address) as channel:
        name = {"unary_unary": "U", "unary_stream": "S", "stream_stream": "B"}[kind]
        call = getattr(channel, kind)(f"/t.T/{name}")
        request = iter([bad]) if kind == "stream_stream" else bad
        e = status_of(lambda: list(call(request, timeout=10)) if kind != "unary_unary"
                      else call(request, timeout=10))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details().startswith("request: is not a valid message")
        assert codes == [grpc.StatusCode.INVALID_ARGUMENT]
        # The server goes on serving.
        assert channel.unary_unary("/t.T/U", Request.SerializeToString, Request.FromString)(
            Request(lora_id=3), timeout=10).lora_id == 3


def test_a_bug_is_internal_logged_and_counted_and_a_downstream_status_passes(caplog):
    """A handler's unexpected exception: INTERNAL (gRPC alone answered UNKNOWN, and
    logged nothing), its traceback in the log, counted; a failed call to another
    service ends the call with that call's status."""
    with served() as (address, codes), grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/t.T/U", Request.SerializeToString, Request.FromString)
        e = status_of(lambda: call(Request(lora_id=500), timeout=10))
        assert e.code() == grpc.StatusCode.INTERNAL and "KeyError" in e.details()
        e = status_of(lambda: call(Request(lora_id=503), timeout=10))
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAVAILABLE, "the worker is gone")
        assert codes == [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE]
        assert call(Request(lora_id=3), timeout=10).lora_id == 3
    logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and "KeyError" in logged[0].exc_text
    assert logged[0].getMessage() == "internal error in /t.T/U"
