"""The public API's GenerateResponses, assembled from the frontend's outputs."""
from __future__ import annotations

from services.common import convert
from services.common.pb import inference_pb2
from services.frontend.choice import ChoiceOutput
from services.frontend.output_processor import GenerationOutput


def generate_responses(output: GenerationOutput) -> list[inference_pb2.GenerateResponse]:
    """One GenerateResponse per choice the output reports; prompt logprobs ride on
    the first of them."""
    responses = []
    for choice in output.outputs:
        response = inference_pb2.GenerateResponse(
            request_id=output.request_id, index=choice.index, text=choice.text,
            token_ids=choice.token_ids,
            logprobs=[convert.logprobs_to_proto(lp) for lp in choice.logprobs or []])
        if choice.finished:
            _set_final_fields(response, choice, len(output.prompt_token_ids))
        responses.append(response)
    if responses and output.prompt_logprobs:
        responses[0].prompt_logprobs.extend(convert.logprobs_to_proto(lp)
                                            for lp in output.prompt_logprobs)
    return responses


def _set_final_fields(response: inference_pb2.GenerateResponse, choice: ChoiceOutput,
                      num_prompt_tokens: int) -> None:
    response.finish_reason = int(choice.finish_reason)
    if choice.cumulative_logprob is not None:
        response.cumulative_logprob = choice.cumulative_logprob
    if isinstance(choice.stop_reason, str):
        response.stop_string = choice.stop_reason
    elif choice.stop_reason is not None:
        response.stop_token_id = choice.stop_reason
    response.usage.CopyFrom(inference_pb2.Usage(
        prompt_tokens=num_prompt_tokens, completion_tokens=choice.num_generated_tokens,
        cached_prompt_tokens=choice.num_cached_tokens))
    response.timings.CopyFrom(inference_pb2.Timings(
        time_to_first_token_s=choice.time_to_first_token_s, total_s=choice.total_s))
