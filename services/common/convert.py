"""Proto <-> dataclass conversion of what the services share: the only place it
happens (the frontend assembles its own responses: services/frontend/responses.py)."""
from __future__ import annotations

import dataclasses
import typing

import numpy as np

from services.common.beam_search import BeamSearch
from services.common.config import EngineConfig
from services.common.errors import (InvalidArgument, LLMServeError, error_with_status,
                                    status_from_number, status_number)
from services.common.lora import LoRARequest
from services.common.pb import common_pb2, config_pb2, engine_core_pb2, worker_pb2
from services.common.request_events import RequestEvent, RequestEventKind
from services.common.pooling_params import PoolingParams
from services.common.request_types import (BeamSequence, EngineCoreOutput, EngineCoreRequest,
                                           EngineInfo, EngineStats, FinishReason, LoadedModel,
                                           Logprobs)
from services.common.sampling_params import OutputKind, SamplingParams
from services.common.scheduler_output import (CachedRequestData, ModelRunnerOutput,
                                              NewRequestData, SchedulerOutput)
from services.common.structured_outputs import StructuredOutputsParams

# ---- sampling params -------------------------------------------------------------

def structured_outputs_from_proto(pb: common_pb2.SamplingParams) -> StructuredOutputsParams | None:
    if not pb.HasField("structured_outputs"):
        return None
    constraint = pb.structured_outputs
    kind = constraint.WhichOneof("constraint")
    if kind is None:
        raise InvalidArgument("sampling_params.structured_outputs",
                              "set one of json, regex, choice, grammar and json_object")
    value = list(constraint.choice.choices) if kind == "choice" else getattr(constraint, kind)
    return StructuredOutputsParams(**{kind: value},
                                   disable_any_whitespace=constraint.disable_any_whitespace)


def structured_outputs_to_proto(params: StructuredOutputsParams | None):
    if params is None:
        return None
    kind = params.kind
    if kind == "choice":
        value = common_pb2.Choices(choices=params.choice)
    else:
        value = params.json_text if kind == "json" else getattr(params, kind)
    return common_pb2.StructuredOutputs(**{kind: value},
                                        disable_any_whitespace=params.disable_any_whitespace)


# Fields whose proto form is not a scalar: (from proto, to proto).
_SAMPLING_COLLECTIONS = {
    "stop_token_ids": (list, list), "stop": (list, list), "allowed_token_ids": (list, list),
    "bad_words": (list, list), "logit_bias": (dict, dict),
    "bad_words_token_ids": (lambda pb: [list(s.token_ids) for s in pb],
                            lambda seqs: [common_pb2.TokenSequence(token_ids=s) for s in seqs]),
}
# Read from the whole message (a oneof needs its parent to tell set from unset).
_SAMPLING_MESSAGES = {"structured_outputs": (structured_outputs_from_proto,
                                             structured_outputs_to_proto)}
_SAMPLING_FIELDS = [f for f in SamplingParams.__dataclass_fields__]


def sampling_params_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Absent fields take SamplingParams' defaults, except output_kind: DELTA, as
    streaming callers of the gRPC API expect."""
    values = {}
    for name in _SAMPLING_FIELDS:
        if name in _SAMPLING_COLLECTIONS:
            values[name] = _SAMPLING_COLLECTIONS[name][0](getattr(pb, name))
        elif name in _SAMPLING_MESSAGES:
            values[name] = _SAMPLING_MESSAGES[name][0](pb)
        elif pb.HasField(name):
            values[name] = getattr(pb, name)
    kind = values.get("output_kind") or OutputKind.DELTA
    if kind not in OutputKind.__members__.values():
        raise InvalidArgument("sampling_params.output_kind", f"{kind} is not an OutputKind")
    values["output_kind"] = OutputKind(kind)
    return SamplingParams(**values)


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    values = {}
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if name in _SAMPLING_COLLECTIONS:
            value = _SAMPLING_COLLECTIONS[name][1](value)
        elif name in _SAMPLING_MESSAGES:
            value = _SAMPLING_MESSAGES[name][1](value)
        elif name == "output_kind":
            value = int(value)
        if value is not None:
            values[name] = value
    return common_pb2.SamplingParams(**values)


def logprobs_to_proto(lp: Logprobs) -> common_pb2.Logprobs:
    return common_pb2.Logprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                               top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs,
                               token=lp.token, top_tokens=lp.top_tokens)


def logprobs_from_proto(pb: common_pb2.Logprobs) -> Logprobs:
    return Logprobs(token_id=pb.token_id, logprob=pb.logprob, rank=pb.rank,
                    top_token_ids=list(pb.top_token_ids), top_logprobs=list(pb.top_logprobs))


def pooling_params_to_proto(p: PoolingParams | None) -> common_pb2.PoolingParams | None:
    if p is None:
        return None
    return common_pb2.PoolingParams(dimensions=p.dimensions, normalize=p.normalize,
                                    truncate_prompt_tokens=p.truncate_prompt_tokens,
                                    pooling_type=p.pooling_type)


def pooling_params_from_proto(message, field: str) -> PoolingParams | None:
    """The PoolingParams in message.<field>, or None when it is not set."""
    if not message.HasField(field):
        return None
    pb = getattr(message, field)
    return PoolingParams(**{f: getattr(pb, f) if pb.HasField(f) else None
                            for f in ("dimensions", "normalize", "truncate_prompt_tokens",
                                      "pooling_type")})


def beam_search_to_proto(b: BeamSearch | None) -> common_pb2.BeamSearch | None:
    if b is None:
        return None
    return common_pb2.BeamSearch(beam_width=b.beam_width, length_penalty=b.length_penalty)


def beam_search_from_proto(message) -> BeamSearch | None:
    """message.beam_search, or None when it is not set."""
    if not message.HasField("beam_search"):
        return None
    pb = message.beam_search
    return BeamSearch(pb.beam_width,
                      pb.length_penalty if pb.HasField("length_penalty") else 1.0)


def beam_sequence_to_proto(b: BeamSequence) -> common_pb2.BeamSequence:
    pb = common_pb2.BeamSequence(token_ids=b.token_ids, cum_logprob=b.cum_logprob,
                                 score=b.score, finish_reason=int(b.finish_reason),
                                 logprobs=[logprobs_to_proto(lp) for lp in b.logprobs])
    if isinstance(b.stop_reason, str):
        pb.stop_string = b.stop_reason
    elif b.stop_reason is not None:
        pb.stop_token_id = b.stop_reason
    return pb


def beam_sequence_from_proto(pb: common_pb2.BeamSequence) -> BeamSequence:
    stop_reason = getattr(pb, pb.WhichOneof("stop_reason")) if pb.WhichOneof("stop_reason") \
        else None
    return BeamSequence(list(pb.token_ids), pb.cum_logprob, pb.score,
                        FinishReason(pb.finish_reason), stop_reason,
                        [logprobs_from_proto(lp) for lp in pb.logprobs])


# ---- engine core -------------------------------------------------------------------

def engine_core_request_to_proto(r: EngineCoreRequest) -> engine_core_pb2.EngineCoreRequest:
    return engine_core_pb2.EngineCoreRequest(
        request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
        sampling_params=sampling_params_to_proto(r.sampling_params),
        eos_token_ids=r.eos_token_ids, trace_headers=r.trace_headers, priority=r.priority,
        queue_slots=r.queue_slots, output_token_ids=r.output_token_ids,
        lora=lora_to_proto(r.lora_request) if r.lora_request else None,
        pooling_params=pooling_params_to_proto(r.pooling_params),
        beam_search=beam_search_to_proto(r.beam_search))


def lora_to_proto(lora: LoRARequest) -> engine_core_pb2.LoRAAdapter:
    return engine_core_pb2.LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id,
                                       path=lora.lora_path)


def lora_from_proto(pb: engine_core_pb2.LoRAAdapter) -> LoRARequest:
    return LoRARequest(pb.name, pb.id, pb.path)


def engine_core_request_from_proto(pb: engine_core_pb2.EngineCoreRequest) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=pb.request_id,
                             prompt_token_ids=list(pb.prompt_token_ids),
                             sampling_params=sampling_params_from_proto(pb.sampling_params),
                             eos_token_ids=list(pb.eos_token_ids),
                             trace_headers=dict(pb.trace_headers), priority=pb.priority,
                             queue_slots=max(1, pb.queue_slots),
                             output_token_ids=list(pb.output_token_ids),
                             lora_request=lora_from_proto(pb.lora) if pb.HasField("lora")
                             else None,
                             pooling_params=pooling_params_from_proto(pb, "pooling_params"),
                             beam_search=beam_search_from_proto(pb))


def engine_core_output_to_proto(o: EngineCoreOutput) -> engine_core_pb2.EngineCoreOutput:
    pb = engine_core_pb2.EngineCoreOutput(
        request_id=o.request_id, new_token_ids=o.new_token_ids,
        num_cached_tokens=o.num_cached_tokens,
        new_logprobs=[logprobs_to_proto(lp) for lp in o.new_logprobs],
        prompt_logprobs=[logprobs_to_proto(lp) for lp in o.prompt_logprobs],
        events=[engine_core_pb2.RequestEvent(kind=int(e.kind), time_unix_nano=e.time_ns,
                                             num_tokens=e.num_tokens) for e in o.events],
        pooled=o.pooled, beams=[beam_sequence_to_proto(b) for b in o.beams],
        num_draft_tokens=o.num_draft_tokens, num_accepted_tokens=o.num_accepted_tokens,
        num_drafts=o.num_drafts)
    if o.finish_reason is not None:
        pb.finish_reason = int(o.finish_reason)
    return pb


def engine_core_output_from_proto(pb: engine_core_pb2.EngineCoreOutput) -> EngineCoreOutput:
    reason = FinishReason(pb.finish_reason) if pb.HasField("finish_reason") else None
    return EngineCoreOutput(request_id=pb.request_id, new_token_ids=list(pb.new_token_ids),
                            finish_reason=reason, num_cached_tokens=pb.num_cached_tokens,
                            new_logprobs=[logprobs_from_proto(p) for p in pb.new_logprobs],
                            prompt_logprobs=[logprobs_from_proto(p) for p in pb.prompt_logprobs],
                            events=[RequestEvent(RequestEventKind(e.kind), e.time_unix_nano,
                                                 e.num_tokens) for e in pb.events],
                            pooled=list(pb.pooled) if pb.pooled else None,
                            beams=[beam_sequence_from_proto(b) for b in pb.beams],
                            num_draft_tokens=pb.num_draft_tokens,
                            num_accepted_tokens=pb.num_accepted_tokens,
                            num_drafts=pb.num_drafts)


def request_error_to_proto(request_id: str,
                           error: LLMServeError) -> engine_core_pb2.EngineCoreOutput:
    """The last output of a request that failed."""
    return engine_core_pb2.EngineCoreOutput(
        request_id=request_id,
        error=engine_core_pb2.RequestError(code=status_number(error.code), message=str(error)))


def request_error_from_proto(pb: engine_core_pb2.RequestError) -> LLMServeError:
    return error_with_status(status_from_number(pb.code), pb.message)


def engine_stats_to_proto(s: EngineStats) -> engine_core_pb2.EngineStats:
    return engine_core_pb2.EngineStats(**vars(s))


def engine_stats_from_proto(pb: engine_core_pb2.EngineStats) -> EngineStats:
    stats = EngineStats(**{f: getattr(pb, f) for f in EngineStats.__dataclass_fields__})
    stats.spec_decode_num_accepted_tokens_per_pos = list(
        pb.spec_decode_num_accepted_tokens_per_pos)
    return stats


def engine_info_to_proto(i: EngineInfo) -> engine_core_pb2.EngineInfo:
    return engine_core_pb2.EngineInfo(**vars(i))


def engine_info_from_proto(pb: engine_core_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(**{f: getattr(pb, f) for f in EngineInfo.__dataclass_fields__})


# ---- worker ------------------------------------------------------------------------

def engine_config_to_proto(config: EngineConfig) -> config_pb2.EngineConfig:
    """Each section into the message of the same name, field by field."""
    return config_pb2.EngineConfig(**{
        name: getattr(config_pb2, type(section).__name__)(**dataclasses.asdict(section))
        for name, section in vars(config).items()})


def engine_config_from_proto(pb: config_pb2.EngineConfig) -> EngineConfig:
    sections = typing.get_type_hints(EngineConfig)
    return EngineConfig(**{
        name: cls(**{f.name: getattr(getattr(pb, name), f.name) for f in dataclasses.fields(cls)})
        for name, cls in sections.items()})


def loaded_model_to_proto(m: LoadedModel) -> worker_pb2.LoadModelResponse:
    return worker_pb2.LoadModelResponse(**vars(m))


def loaded_model_from_proto(pb: worker_pb2.LoadModelResponse) -> LoadedModel:
    return LoadedModel(vocab_size=pb.vocab_size, dtype=pb.dtype, kv_block_bytes=pb.kv_block_bytes,
                       hidden_size=pb.hidden_size)


def scheduler_output_to_proto(so: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    return worker_pb2.SchedulerOutput(
        step_id=so.step_id,
        new_requests=[worker_pb2.NewRequestData(
            request_id=r.request_id, token_ids=r.token_ids,
            sampling_params=sampling_params_to_proto(r.sampling_params),
            block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
            trace_headers=r.trace_headers, eos_token_ids=r.eos_token_ids,
            num_prompt_tokens=r.num_prompt_tokens, lora_id=r.lora_id,
            pooling_params=pooling_params_to_proto(r.pooling_params)) for r in so.new_requests],
        cached_requests=[worker_pb2.CachedRequestData(
            request_id=r.request_id, new_block_ids=r.new_block_ids,
            num_computed_tokens=r.num_computed_tokens, new_token_ids=r.new_token_ids)
            for r in so.cached_requests],
        num_scheduled_tokens=so.num_scheduled_tokens,
        finished_request_ids=so.finished_request_ids,
        grammar_bitmasks={r: m.astype("<i4").tobytes() for r, m in so.grammar_bitmasks.items()},
        blocks_to_copy=[worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in so.blocks_to_copy],
        scheduled_spec_decode_tokens={r: worker_pb2.TokenIds(token_ids=t)
                                      for r, t in so.scheduled_spec_decode_tokens.items()},
        requests_to_draft=so.requests_to_draft)


def scheduler_output_from_proto(pb: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=pb.step_id,
        new_requests=[NewRequestData(
            request_id=r.request_id, token_ids=list(r.token_ids),
            sampling_params=sampling_params_from_proto(r.sampling_params),
            block_ids=list(r.block_ids), num_computed_tokens=r.num_computed_tokens,
            trace_headers=dict(r.trace_headers), eos_token_ids=list(r.eos_token_ids),
            num_prompt_tokens=r.num_prompt_tokens, lora_id=r.lora_id,
            pooling_params=pooling_params_from_proto(r, "pooling_params"))
            for r in pb.new_requests],
        cached_requests=[CachedRequestData(
            request_id=r.request_id, new_block_ids=list(r.new_block_ids),
            num_computed_tokens=r.num_computed_tokens, new_token_ids=list(r.new_token_ids))
            for r in pb.cached_requests],
        # Sorted: a proto map's iteration order depends on the process (upb seeds
        # its hash with an address), and tensor-parallel ranks must lay the step's
        # tokens out in one order, or the all-reduce adds up different tokens.
        num_scheduled_tokens=dict(sorted(pb.num_scheduled_tokens.items())),
        finished_request_ids=list(pb.finished_request_ids),
        grammar_bitmasks={r: np.frombuffer(m, dtype="<i4").astype(np.int32)
                          for r, m in pb.grammar_bitmasks.items()},
        blocks_to_copy=[(c.src, c.dst) for c in pb.blocks_to_copy],
        scheduled_spec_decode_tokens={r: list(t.token_ids)
                                      for r, t in pb.scheduled_spec_decode_tokens.items()},
        requests_to_draft=list(pb.requests_to_draft))


def model_runner_output_to_proto(o: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    outputs = []
    for request_id in {**o.sampled_token_ids, **o.prompt_logprobs, **o.pooled}:
        outputs.append(worker_pb2.RequestStepOutput(
            request_id=request_id, sampled_token_ids=o.sampled_token_ids.get(request_id),
            logprobs=[logprobs_to_proto(lp) for lp in o.logprobs.get(request_id, [])],
            prompt_logprobs=[logprobs_to_proto(lp) for lp in o.prompt_logprobs.get(request_id, [])],
            pooled=o.pooled.get(request_id), spec_token_ids=o.spec_token_ids.get(request_id)))
    return worker_pb2.ModelRunnerOutput(outputs=outputs)


def model_runner_output_from_proto(pb: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    output = ModelRunnerOutput()
    for r in pb.outputs:
        if r.sampled_token_ids:
            output.sampled_token_ids[r.request_id] = list(r.sampled_token_ids)
        if r.logprobs:
            output.logprobs[r.request_id] = [logprobs_from_proto(p) for p in r.logprobs]
        if r.spec_token_ids:
            output.spec_token_ids[r.request_id] = list(r.spec_token_ids)
        if r.prompt_logprobs:
            output.prompt_logprobs[r.request_id] = [logprobs_from_proto(p)
                                                    for p in r.prompt_logprobs]
        if r.pooled:
            output.pooled[r.request_id] = list(r.pooled)
    return output
