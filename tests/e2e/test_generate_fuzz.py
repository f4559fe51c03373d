"""Thousands of random GenerateRequests against the real three-process stack:
every field, extreme values, random text, and random or corrupted bytes on the
wire. Each ends OK or with a client-error status (never UNKNOWN or INTERNAL),
and afterwards the server is healthy and holds no KV block."""
import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings, strategies as st

from services.common.pb import common_pb2, inference_pb2
from tests.e2e.conftest import address, health_status, wait_all_blocks_free

pytestmark = pytest.mark.e2e

GENERATE = "/llmserve.v1.Inference/Generate"
CLIENT_ERRORS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                 # The test's own deadline, for requests that would run long.
                 grpc.StatusCode.DEADLINE_EXCEEDED}
U32 = 2**32 - 1

# Mostly small and valid values, with the extremes of each type mixed in.
small_u32 = st.one_of(st.integers(0, 8), st.integers(0, 60_000), st.sampled_from([U32, 2**31]))
token_ids = st.lists(st.one_of(st.integers(0, 49_151), st.integers(0, U32)), max_size=12)
floats = st.one_of(st.floats(-3, 3, width=32), st.floats(width=32))  # nan, inf, huge
text = st.text(max_size=40)

sampling_params = st.fixed_dictionaries({
    # Mostly short: a valid request runs for real (one that runs long ends at the
    # test's deadline), and thousands of them must fit in a few minutes.
    "max_tokens": st.one_of(*[st.integers(0, 2)] * 6, st.sampled_from([16, U32, 2048, 10**6])),
}, optional={
    "temperature": floats, "top_p": floats, "top_k": small_u32,
    "seed": st.one_of(st.integers(0, 100), st.just(2**64 - 1)),
    "stop_token_ids": token_ids, "ignore_eos": st.booleans(),
    "n": st.one_of(st.integers(0, 3), st.sampled_from([17, U32])),
    "min_tokens": small_u32, "min_p": floats, "repetition_penalty": floats,
    "presence_penalty": floats, "frequency_penalty": floats,
    "logprobs": st.one_of(st.integers(0, 3), st.sampled_from([21, U32])),
    "prompt_logprobs": st.one_of(st.integers(0, 3), st.sampled_from([21, U32])),
    "stop": st.lists(text, max_size=3), "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(), "output_kind": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, U32), floats, max_size=3),
    "allowed_token_ids": token_ids, "bad_words": st.lists(text, max_size=3),
})
inputs = st.one_of(
    st.fixed_dictionaries({"prompt": text}),
    st.fixed_dictionaries({"token_ids": token_ids}),
    st.fixed_dictionaries({"chat": st.lists(st.tuples(
        st.sampled_from(["user", "assistant", "system", ""]) | text, text), max_size=3)}))


@st.composite
def generate_requests(draw) -> bytes:
    """A serialized GenerateRequest; sometimes corrupted, sometimes pure noise."""
    request = inference_pb2.GenerateRequest()
    source = draw(inputs)
    if "prompt" in source:
        request.prompt = source["prompt"]
    elif "token_ids" in source:
        request.token_ids.ids.extend(source["token_ids"])
    else:
        request.chat.messages.extend(inference_pb2.ChatMessage(role=r, content=c)
                                     for r, c in source["chat"])
    params = draw(sampling_params)
    # Absent about one time in ten: all defaults, 16 tokens. (Hypothesis favours
    # small draws, so the rare case is the large one.)
    if draw(st.integers(0, 9)) < 9:
        request.sampling_params.CopyFrom(_sampling_params(params))
    if draw(st.booleans()):
        request.request_id = draw(st.one_of(text, st.just(""), st.just("r" * 300)))
    request.priority = draw(st.integers(-2**31, 2**31 - 1))
    wire = request.SerializeToString()
    damage = draw(st.sampled_from(["none"] * 8 + ["flip", "noise"]))
    if damage == "flip" and wire:
        at = draw(st.integers(0, len(wire) - 1))
        wire = wire[:at] + bytes([wire[at] ^ draw(st.integers(1, 255))]) + wire[at + 1:]
    elif damage == "noise":
        wire = draw(st.binary(max_size=64))
    return wire


def _sampling_params(params: dict) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams()
    for name, value in params.items():
        field = getattr(pb, name)
        if name == "logit_bias":
            field.update(value)
        elif isinstance(value, list):
            field.extend(value)
        else:
            setattr(pb, name, value)
    return pb


@pytest.fixture(scope="module")
def generate(stack):
    channel = grpc.insecure_channel(address(stack, "frontend"))
    # Raw bytes in, so the test can send what no generated stub would.
    call = channel.unary_stream(GENERATE, request_serializer=None,
                                response_deserializer=inference_pb2.GenerateResponse.FromString)
    yield call
    channel.close()


@settings(max_examples=2000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(wire=generate_requests())
def test_random_requests_end_ok_or_with_a_client_error(generate, wire):
    stream = generate(wire, timeout=0.5)
    try:
        for _ in stream:
            pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code in CLIENT_ERRORS, (code, e.details(), wire)


def test_the_server_is_healthy_and_holds_no_kv_block_afterwards(stack):
    assert health_status(address(stack, "frontend")) == health_pb2.HealthCheckResponse.SERVING
    stats = wait_all_blocks_free(stack, timeout_s=30)
    assert stats.num_waiting == 0
