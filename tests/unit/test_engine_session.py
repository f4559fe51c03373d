"""The engine core's Session stream over real gRPC (fake executor): one message per
step for all of a session's requests, a bad request's error in the stream while
the others go on, and aborts (explicit, or by closing the session) that free
every KV block."""
import asyncio
import time

import grpc
import pytest

from services.common import convert
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from services.common.errors import LLMServeError
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.request_types import EngineCoreRequest, SamplingParams
from services.engine_core.engine_core import EngineCore
from services.engine_core.engine_loop import EngineLoop
from services.engine_core.servicer import EngineCoreServicer
from services.engine_core.session import EngineSession
from services.frontend.engine_client import GrpcEngineClient
from tests.unit.fake_executor import FakeExecutor, reference_tokens
from tests.waiting import until

MAX_MODEL_LEN = 64


class _SlowExecutor(FakeExecutor):
    """Steps of a few milliseconds, as a model's: requests overlap, and a client
    sees a request running before it ends."""

    def execute_model(self, so):
        time.sleep(0.005)
        return super().execute_model(so)


async def _serve(engine: EngineLoop) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    engine_core_pb2_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _engine() -> EngineLoop:
    config = EngineConfig(model=ModelConfig(model="fake", max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(block_size=4))
    return EngineLoop(EngineCore(config, _SlowExecutor(num_blocks=64, block_size=4)))


def _request(i: int, max_tokens: int = 6, prompt_len: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(f"r{i}", [10 + i] * prompt_len,
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _run(test) -> None:
    engine = _engine()

    async def main():
        server, address = await _serve(engine)
        try:
            await test(engine, address)
        finally:
            await server.stop(None)
    try:
        asyncio.run(main())
        assert engine.core.stats().num_used_kv_blocks == 0
    finally:
        asyncio.run(engine.shutdown())


async def _tokens(client: GrpcEngineClient, request: EngineCoreRequest) -> list[int]:
    return [t async for output in client.generate(request) for t in output.new_token_ids]


def test_requests_share_one_message_per_step_and_match_the_reference():
    async def test(engine, address):
        stub = engine_core_pb2_grpc.EngineCoreStub(grpc.aio.insecure_channel(address))
        adds = [engine_core_pb2.SessionRequest(add=convert.engine_core_request_to_proto(
            _request(i, max_tokens=20))) for i in range(3)]
        call = stub.Session(iter(adds))
        tokens: dict[str, list[int]] = {}
        most_in_a_message, finished = 0, 0
        async for message in call:
            for output in message.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                finished += output.HasField("finish_reason")
            most_in_a_message = max(most_in_a_message, len(message.outputs))
            if finished == 3:
                break
        call.cancel()
        assert most_in_a_message == 3  # once all three run, a step's outputs share a message
        for i in range(3):
            assert tokens[f"r{i}"] == reference_tokens([10 + i] * 3, 20, set(), MAX_MODEL_LEN)
    _run(test)


def test_a_bad_request_fails_alone_with_its_status():
    async def test(engine, address):
        client = GrpcEngineClient(address)
        too_long = _request(1, prompt_len=MAX_MODEL_LEN + 1)
        good, bad = await asyncio.gather(_tokens(client, _request(0)), _tokens(client, too_long),
                                         return_exceptions=True)
        assert good == reference_tokens([10] * 3, 6, set(), MAX_MODEL_LEN)
        assert isinstance(bad, LLMServeError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_model_len" in str(bad) or str(MAX_MODEL_LEN) in str(bad)
        await client.close()
    _run(test)


def test_a_duplicate_request_id_is_refused_in_the_stream():
    async def test(engine, address):
        stub = engine_core_pb2_grpc.EngineCoreStub(grpc.aio.insecure_channel(address))
        add = engine_core_pb2.SessionRequest(add=convert.engine_core_request_to_proto(
            _request(0, max_tokens=40)))
        call = stub.Session(iter([add, add]))
        refused = running = False
        async for message in call:
            for output in message.outputs:
                if output.HasField("error"):
                    assert output.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
                    refused = True
                running |= bool(output.new_token_ids)
            # The refusal can arrive before the first add reaches the engine: wait for
            # its tokens, so that closing the session has a running request to abort.
            if refused and running:
                break
        assert refused and running, "the stream ended before the refusal or the first tokens"
        call.cancel()
        await _until_idle(engine)
    _run(test)


@pytest.mark.parametrize("how", ["abort", "close"])
def test_leaving_a_request_or_closing_the_session_aborts_it(how):
    async def test(engine, address):
        client = GrpcEngineClient(address)
        generation = client.generate(_request(0, max_tokens=MAX_MODEL_LEN - 4))
        await generation.__anext__()
        assert engine.num_in_flight() == 1
        if how == "abort":
            await generation.aclose()
        else:
            await client.close()
            with pytest.raises(LLMServeError):
                async for _ in generation:
                    pass
        await _until_idle(engine)
        if how == "abort":  # the session stays open for the next request
            assert len(await _tokens(client, _request(1))) == 6
            await client.close()
    _run(test)


def test_an_add_aborted_before_its_task_ran_leaves_its_id_free():
    """The abort right behind its add, read before the add's task first ran: the
    request never starts, and its id is free again at once (it stayed taken)."""
    async def test(engine, address):
        session = EngineSession(engine)
        add = engine_core_pb2.SessionRequest(add=convert.engine_core_request_to_proto(
            _request(0)))
        abort = engine_core_pb2.SessionRequest(abort=engine_core_pb2.AbortRequest(
            request_ids=["r0"]))
        await session.take(_messages(add, abort))
        await asyncio.sleep(0.05)  # the cancelled add's callback, and a loop pass
        assert engine.num_in_flight() == 0 and not engine.core.has_work()
        await session.take(_messages(add))
        outputs, tokens = session.outputs(), []
        while not (tokens and tokens[-1].HasField("finish_reason")):
            message = await asyncio.wait_for(anext(outputs), 10)
            assert not any(o.HasField("error") for o in message.outputs), message
            tokens.extend(message.outputs)
        assert [t for o in tokens for t in o.new_token_ids] == reference_tokens(
            [10] * 3, 6, set(), MAX_MODEL_LEN)
        session.close()
    _run(test)


async def _messages(*messages):
    """A stream's messages, each read without a pass of the event loop between."""
    for message in messages:
        yield message


async def _until_idle(engine: EngineLoop) -> None:
    await until(lambda: engine.num_in_flight() == 0 and not engine.core.has_work(),
                "no request in flight")
