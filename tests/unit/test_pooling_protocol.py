"""Pooling requests cross both gRPC hops intact (frontend -> engine core, engine
core -> workers, and the vectors back), and PoolingParams refuse what a person
has to change, by field."""
import pytest

from services.common import convert
from services.common.errors import InvalidArgument
from services.common.pooling_params import PoolingParams, truncate_prompt
from services.common.request_types import EngineCoreOutput, EngineCoreRequest, FinishReason
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

PARAMS = [PoolingParams(), PoolingParams(dimensions=8, normalize=False,
                                         truncate_prompt_tokens=-1, pooling_type="MEAN"),
          PoolingParams(normalize=True, pooling_type="CLS")]
VECTOR = [0.5, -0.25, 1.0, 3.0]  # float32 values: the proto carries floats


@pytest.mark.parametrize("params", PARAMS)
def test_engine_core_request_and_output_round_trip(params):
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=1),
                                pooling_params=params)
    assert convert.engine_core_request_from_proto(
        convert.engine_core_request_to_proto(request)) == request
    output = EngineCoreOutput("r", [], FinishReason.STOP, 0, pooled=VECTOR)
    assert convert.engine_core_output_from_proto(
        convert.engine_core_output_to_proto(output)) == output


def test_generation_requests_carry_no_pooling():
    request = EngineCoreRequest("g", [1], SamplingParams())
    back = convert.engine_core_request_from_proto(convert.engine_core_request_to_proto(request))
    assert back.pooling_params is None
    output = convert.engine_core_output_from_proto(convert.engine_core_output_to_proto(
        EngineCoreOutput("g", [7])))
    assert output.pooled is None


@pytest.mark.parametrize("params", PARAMS)
def test_worker_step_round_trip(params):
    step = SchedulerOutput(step_id=3, new_requests=[
        NewRequestData("p", [1, 2, 3], SamplingParams(max_tokens=1), [0], 0,
                       pooling_params=params),
        NewRequestData("g", [4, 5], SamplingParams(), [1], 0)],
        num_scheduled_tokens={"p": 3, "g": 2})
    back = convert.scheduler_output_from_proto(convert.scheduler_output_to_proto(step))
    assert [r.pooling_params for r in back.new_requests] == [params, None]
    result = ModelRunnerOutput(sampled_token_ids={"g": [9]}, pooled={"p": VECTOR})
    assert convert.model_runner_output_from_proto(
        convert.model_runner_output_to_proto(result)) == result


@pytest.mark.parametrize("params, field", [
    (PoolingParams(dimensions=0), "dimensions"), (PoolingParams(dimensions=577), "dimensions"),
    (PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (PoolingParams(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (PoolingParams(pooling_type="MAX"), "pooling_type")])
def test_bad_params_name_their_field(params, field):
    with pytest.raises(InvalidArgument) as err:
        params.validate(hidden_size=576)
    assert err.value.field == field
    PoolingParams(dimensions=576, truncate_prompt_tokens=-1).validate(hidden_size=576)


def test_truncation_keeps_the_last_tokens():
    ids = list(range(10))
    assert truncate_prompt(ids, PoolingParams(), 4) == ids
    assert truncate_prompt(ids, PoolingParams(truncate_prompt_tokens=3), 4) == [7, 8, 9]
    assert truncate_prompt(ids, PoolingParams(truncate_prompt_tokens=-1), 4) == [6, 7, 8, 9]
    resolved = PoolingParams(normalize=False).resolved("MEAN", True)
    assert (resolved.pooling_type, resolved.normalize) == ("MEAN", False)
