"""Structured outputs through the real stack: the gRPC API's structured_outputs
message, and over HTTP OpenAI's response_format and vLLM's structured_outputs;
a constraint that does not compile is INVALID_ARGUMENT / 400 naming it and
leaves the others' requests alone."""
import json
import re

import grpc
import jsonschema
import openai
import pytest

from llmserve import StructuredOutputsParams
from llmserve.client import Client
from tests.e2e.conftest import COMPILE_TIMEOUT_S, address, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer", "minimum": 0}}}
DATE_REGEX = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"


@pytest.fixture(scope="module")
def http(stack):
    return openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="unused",
                         max_retries=0)


def _grpc_texts(client: Client, **kwargs) -> list[str]:
    """Each choice's whole text (DELTA messages joined)."""
    texts: dict[int, str] = {}
    for response in client.generate(**kwargs):
        texts[response.index] = texts.get(response.index, "") + response.text
    return [texts[i] for i in sorted(texts)]


def test_grpc_constraints(stack):
    with Client(address(stack, "frontend")) as client:
        texts = _grpc_texts(client, prompt="The largest city in Japan, as JSON:", max_tokens=80,
                            temperature=0.9, seed=5, n=2,
                            structured_outputs=StructuredOutputsParams(json=CITY))
        assert len(texts) == 2
        for text in texts:
            jsonschema.validate(json.loads(text), CITY)
        [text] = _grpc_texts(client, prompt="Today's date is", max_tokens=20, temperature=0,
                             structured_outputs=StructuredOutputsParams(regex=DATE_REGEX))
        assert re.fullmatch(DATE_REGEX, text), text
        with pytest.raises(grpc.RpcError) as err:
            _grpc_texts(client, prompt="Hi", max_tokens=8,
                        structured_outputs=StructuredOutputsParams(regex="[unclosed"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs.regex" in err.value.details()
    wait_all_blocks_free(stack)


def test_http_response_format_json_schema_and_json_object(http):
    chat = http.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a big city as JSON."}],
        max_completion_tokens=80, temperature=0.7, seed=1,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), CITY)
    chat = http.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a dog in JSON."}],
        max_completion_tokens=120, temperature=0, response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    assert chat.choices[0].message.content.startswith("{")


def test_http_structured_outputs_field(http):
    answers = http.completions.create(
        model=MODEL, prompt=["Is the sky blue? Answer:", "Is fire cold? Answer:"], max_tokens=8,
        temperature=1.0, seed=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [c.text for c in answers.choices] and all(c.text in ("yes", "no")
                                                     for c in answers.choices)
    streamed = http.completions.create(
        model=MODEL, prompt="Today's date is", max_tokens=20, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": DATE_REGEX}})
    assert re.fullmatch(DATE_REGEX, "".join(c.choices[0].text for c in streamed))


@pytest.mark.parametrize("body, field", [
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "root ::= undefined"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format"),
])
def test_http_bad_constraints_are_400_naming_them(http, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        http.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
    assert field in err.value.body["message"], err.value.body
    assert err.value.body["type"] == "invalid_request_error"
    assert http.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_http_a_compile_over_the_limit_is_400_naming_the_limit(stack, http):
    """The shared stack compiles within COMPILE_TIMEOUT_S: a pattern xgrammar
    would compile for minutes is stopped there, and the server goes on."""
    schema = {"type": "object", "properties": {"code": {"type": "string",
                                                         "pattern": "^[a-z]{1,50000}$"}}}
    with pytest.raises(openai.BadRequestError) as err:
        http.completions.create(model=MODEL, prompt="Code:", max_tokens=8,
                                extra_body={"structured_outputs": {"json": schema}})
    message = err.value.body["message"]
    assert "structured_outputs.json" in message
    assert "--structured-outputs-compile-timeout" in message
    assert f"within {COMPILE_TIMEOUT_S:g} s" in message
    assert http.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    wait_all_blocks_free(stack)
