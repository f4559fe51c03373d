"""Beam search served: the official openai client (use_beam_search, vLLM's extra
field) and gRPC (GenerateRequest.beam_search) against the shared three-process
stack. The beams equal transformers' (prompts that run to max_tokens, where the
two searches rank alike); stop strings end beams; streaming and bad widths are
refused clearly; every KV block is free afterwards."""
import grpc
import openai
import pytest

from llmserve.client import Client
from services.common.beam_search import BeamSearch
from tests.e2e.conftest import address, wait_all_blocks_free
from tests.integration.test_beam_search import hf_beams

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="unused",
                         max_retries=0)


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer) -> list[str]:
    """transformers' three beams of PROMPT, as text."""
    beams = hf_beams(hf_model, tokenizer(PROMPT)["input_ids"], 3, 10)
    return [tokenizer.decode(b, skip_special_tokens=True) for b in beams]


def test_completions_with_beam_search_return_transformers_beams(client, stack, reference):
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, n=3,
        extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == reference
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert completion.usage.completion_tokens == 30
    wait_all_blocks_free(stack)


def test_chat_with_beam_search_and_a_stop_string(client, stack):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name the three primary colors."}],
        max_completion_tokens=40, temperature=0, n=2, stop=[","],
        extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert len(chat.choices) == 2
    assert all("," not in c.message.content for c in chat.choices)
    assert any(c.finish_reason == "stop" for c in chat.choices)
    assert chat.choices[0].message.content != chat.choices[1].message.content
    wait_all_blocks_free(stack)


def test_streaming_and_bad_widths_are_refused(client, stack):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, stream=True,
                                  extra_body={"use_beam_search": True})
    assert "stream" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=11,
                                  extra_body={"use_beam_search": True})
    assert "is the beam width with use_beam_search: at most 10" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2,
                                  extra_body={"use_beam_search": True, "min_tokens": 2})
    assert "min_tokens" in str(err.value)
    wait_all_blocks_free(stack)


def test_grpc_returns_the_beams_as_choices_on_the_last_messages(stack, reference):
    with Client(address(stack, "frontend")) as client:
        responses = list(client.generate(PROMPT, max_tokens=10, temperature=0, ignore_eos=True,
                                         beam_search=BeamSearch(3)))
        assert [r.index for r in responses] == [0, 1, 2]
        assert [r.text for r in responses] == reference
        cums = [r.cumulative_logprob for r in responses]
        assert all(r.HasField("cumulative_logprob") for r in responses)
        assert cums == sorted(cums, reverse=True)  # equal lengths: the score's order
        assert all(r.usage.completion_tokens == 10 for r in responses)
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(PROMPT, max_tokens=4, n=2, beam_search=BeamSearch(2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.n" in err.value.details()
    wait_all_blocks_free(stack)
