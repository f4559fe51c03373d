"""The public API over real gRPC: every error path, stop strings, output kinds,
n > 1, logprobs, tokenize / detokenize."""
import concurrent.futures

import grpc
import pytest

from llmserve.client import Client
from services.common.pb import common_pb2
from services.common.sampling_params import OutputKind
from tests.e2e.conftest import (MAX_NUM_SEQS, MAX_WAITING, address, engine_stats,
                               wait_all_blocks_free, wait_for_engine_stat)

pytestmark = pytest.mark.e2e

PROMPT = "The three primary colors are"


@pytest.fixture
def client(stack):
    with Client(address(stack, "frontend")) as c:
        yield c


def collect(stream):
    return list(stream)


def error_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        collect(call())
    return err.value


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0.0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ({"prompt": PROMPT, "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"token_ids": [1, 2, 49152]}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ({}, "input"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "word " * 3000}, "max_model_len"),
    # The documented bounds (protos/common.proto, protos/inference.proto).
    ({"prompt": PROMPT, "n": 17}, "n"),
    ({"prompt": PROMPT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": PROMPT, "stop": ["x" * 257]}, "stop"),
    ({"prompt": PROMPT, "request_id": "r" * 257}, "request_id"),
    ({"prompt": "x" * (32 * 2048 + 1)}, "prompt"),
    ({"chat": [{"role": "user", "content": "x" * (32 * 2048 + 1)}]}, "chat.messages"),
])
def test_invalid_arguments_name_the_field(client, kwargs, field):
    err = error_of(lambda: client.generate(**kwargs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()


def test_duplicate_live_request_id_is_already_exists(stack, client):
    first = client.generate(PROMPT, request_id="dup", max_tokens=300, ignore_eos=True)
    next(first)
    err = error_of(lambda: client.generate(PROMPT, request_id="dup", max_tokens=4))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
    first.cancel()
    wait_all_blocks_free(stack)
    assert collect(client.generate(PROMPT, request_id="dup", max_tokens=2))[-1].usage.completion_tokens == 2


def test_an_id_reused_the_moment_its_request_was_cut_starts_a_new_request(stack, client):
    """Back-to-back requests under one id, each cut by its deadline: each is a
    request of its own. The engine core knew them by that same id once, and the
    last output of one (its ABORT) ended the next one's stream, which then ran on
    in the engine unread, holding its KV blocks (found by the fuzz test)."""
    codes = []
    for _ in range(30):
        try:
            collect(client.generate(PROMPT, request_id="reused", max_tokens=10**6,
                                    ignore_eos=True, timeout=0.3))
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    # ALREADY_EXISTS: the frontend had yet to see the last call's end; never OK
    # (finished early by another's output).
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ALREADY_EXISTS}
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= 10, codes
    wait_all_blocks_free(stack)


def test_full_waiting_queue_is_resource_exhausted_and_harms_nobody(stack, client):
    def start(n):
        return [client.generate(f"{i} {PROMPT}", max_tokens=2000, ignore_eos=True)
                for i in range(n)]

    streams = start(MAX_NUM_SEQS)
    wait_for_engine_stat(stack, "num_running", MAX_NUM_SEQS)
    streams += start(MAX_WAITING)
    wait_for_engine_stat(stack, "num_waiting", MAX_WAITING)
    err = error_of(lambda: client.generate(PROMPT, max_tokens=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in err.details()
    for s in streams:
        s.cancel()
    wait_all_blocks_free(stack)
    assert engine_stats(stack).num_waiting == 0
    assert collect(client.generate(PROMPT, max_tokens=3))[-1].usage.completion_tokens == 3


def test_output_kinds_agree(client):
    common = dict(prompt=PROMPT, max_tokens=24, temperature=0, stop=["\n\n"])
    delta = collect(client.generate(**common))
    cumulative = collect(client.generate(**common, output_kind=OutputKind.CUMULATIVE))
    final = collect(client.generate(**common, output_kind=OutputKind.FINAL_ONLY))
    delta_text = "".join(r.text for r in delta)
    assert len(delta) > 1 and len(final) == 1
    assert delta_text == cumulative[-1].text == final[0].text
    assert [t for r in delta for t in r.token_ids] == list(cumulative[-1].token_ids) == \
        list(final[0].token_ids)
    texts = [r.text for r in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_stop_string_across_token_boundaries(client):
    full = collect(client.generate(PROMPT, max_tokens=24, temperature=0, output_kind=OutputKind.FINAL_ONLY))[0]
    tokens = list(full.token_ids)
    pieces = [client.detokenize(tokens[:i]) for i in range(len(tokens) + 1)]
    # A stop string that starts inside one token and ends inside a later one.
    boundary = next(i for i in range(2, len(tokens)) if len(pieces[i]) - len(pieces[i - 1]) >= 2
                    and len(pieces[i + 1]) - len(pieces[i]) >= 2)
    cut = len(pieces[boundary]) - 1
    stop = pieces[-1][cut:cut + 3]
    assert pieces[-1].find(stop) == cut

    responses = collect(client.generate(PROMPT, max_tokens=24, temperature=0, stop=[stop]))
    text = "".join(r.text for r in responses)
    last = responses[-1]
    assert text == pieces[-1][:cut]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.stop_string == stop
    assert last.usage.completion_tokens < len(tokens)
    included = collect(client.generate(PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                       include_stop_str_in_output=True))
    assert "".join(r.text for r in included) == pieces[-1][:cut + len(stop)]


def test_stop_token_id_is_reported(client):
    full = collect(client.generate(PROMPT, max_tokens=10, temperature=0,
                                   output_kind=OutputKind.FINAL_ONLY))[0]
    stop_id = full.token_ids[4]
    last = collect(client.generate(PROMPT, max_tokens=10, temperature=0,
                                   stop_token_ids=[stop_id]))[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.stop_token_id == stop_id


def test_n_choices_with_a_seed_are_reproducible(client):
    def run():
        choices = {}
        for r in client.generate(PROMPT, n=3, seed=11, temperature=1.0, max_tokens=16,
                                 ignore_eos=True):
            choices.setdefault(r.index, []).extend(r.token_ids)
            if r.HasField("finish_reason"):
                assert r.usage.completion_tokens == 16
        return choices
    first, second = run(), run()
    assert sorted(first) == [0, 1, 2] and first == second
    assert len({tuple(v) for v in first.values()}) == 3


def test_logprobs_carry_token_strings(client):
    responses = collect(client.generate(PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                        prompt_logprobs=1))
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for r in responses for t in r.token_ids]
    assert all(lp.rank == 1 and lp.logprob <= 0 and len(lp.top_tokens) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == "".join(r.text for r in responses)
    prompt_ids = client.tokenize(PROMPT)
    assert [lp.token_id for lp in responses[0].prompt_logprobs] == prompt_ids[1:]


def test_tokenize_detokenize_and_model_info(client):
    ids = client.tokenize(PROMPT)
    assert client.detokenize(ids) == PROMPT
    chat_ids = client.tokenize(chat=[{"role": "user", "content": "hi"}])
    assert client.detokenize(chat_ids, skip_special_tokens=False).startswith("<|im_start|>")
    info = client.model_info()
    assert info.eos_token_ids == [2] and info.max_model_len == 2048 and info.block_size == 16
    with pytest.raises(grpc.RpcError) as err:
        client.detokenize([10**6])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_streams_do_not_disturb_each_other(client):
    prompts = [f"Fact number {i}:" for i in range(6)]
    alone = [collect(client.generate(p, max_tokens=12, temperature=0)) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: collect(client.generate(p, max_tokens=12,
                                                                   temperature=0)), prompts))
    text = lambda rs: "".join(r.text for r in rs)  # noqa: E731
    assert [text(r) for r in together] == [text(r) for r in alone]
