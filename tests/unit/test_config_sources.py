"""Every engine setting is declared once (services/common/config.py); the flags,
EngineArgs, the argv to child processes and the proto messages agree with the
declarations, and round-trip every field."""
import argparse
import dataclasses
import json
import typing

import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve import LLM
from llmserve.engine_args import TRANSLATED_ARGS, EngineArgs
from services.common import convert
from services.common.config import EngineConfig
from services.common.config_cli import (add_engine_args, cli_settings, engine_args_to_argv,
                                        engine_config_from_args, parse_args_refusing_vllm_flags)
from services.common.pb import config_pb2
from services.common.setting import OFFLINE, declared_settings, setting_groups
from services.common.vllm_names import VLLM_ENGINE_ARGS

SETTINGS = list(declared_settings(EngineConfig))
# int64 and double: every int and float a config holds survives the trip.
_PROTO_TYPES = {bool: FieldDescriptor.TYPE_BOOL, int: FieldDescriptor.TYPE_INT64,
                float: FieldDescriptor.TYPE_DOUBLE, str: FieldDescriptor.TYPE_STRING}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    return parser


# ---- the declarations ----------------------------------------------------------------

def test_every_config_field_is_a_declared_setting_with_help_and_a_typed_default():
    for section in dataclasses.fields(EngineConfig):
        section_cls = typing.get_type_hints(EngineConfig)[section.name]
        declared = {s.name for s in SETTINGS if s.section == section.name}
        assert declared == {f.name for f in dataclasses.fields(section_cls)}, section.name
    for s in SETTINGS:
        assert s.type in (bool, int, float, str) and type(s.default) is s.type, s.arg
        assert len(s.meta.help) > 10, s.arg
        assert not s.meta.choices or s.default in s.meta.choices, s.arg
    assert len({(s.group, s.arg) for s in SETTINGS}) == len(SETTINGS)


def test_vllm_names_are_claimed_exactly_where_vllm_has_them():
    """A setting marked as vLLM's has vLLM's name; one that is llmserve's own must
    not take a name vLLM gives another meaning."""
    for s in SETTINGS:
        if s.group is None:
            assert (s.arg in VLLM_ENGINE_ARGS) == s.meta.vllm, s.arg
        else:  # a key of vLLM's dict argument (speculative_config)
            assert s.group in VLLM_ENGINE_ARGS, s.group
    assert {"gpu_memory_utilization", "enforce_eager", "tensor_parallel_size",
            "attention_backend", "async_scheduling", "scheduling_policy"} <= {
        s.arg for s in SETTINGS if s.meta.vllm}


# ---- flags -> config -> argv -> config ---------------------------------------------------

def _user_value(s):
    """Any value a user could give the setting (value aliases included)."""
    if s.meta.choices:
        return st.sampled_from(s.meta.choices + tuple(s.meta.value_aliases))
    if s.user_type is bool:
        return st.booleans()
    if s.user_type is int:
        return st.integers(-2 ** 62, 2 ** 62)
    if s.user_type is float:
        if s.meta.scale != 1:  # a GiB count of whole bytes
            return st.integers(0, 2 ** 50).map(lambda n: n / s.meta.scale)
        return st.floats(allow_nan=False, allow_infinity=False)
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


def _valid_group(members):
    """A group's dict, valid together: speculative_config off, or with a method (and a
    draft model for draft_model)."""
    by_key = {s.arg: s for s in members}
    counts = st.integers(0, 2 ** 20)

    def with_method(method):
        return st.fixed_dictionaries(
            {"method": st.just(method), "num_speculative_tokens": counts,
             "prompt_lookup_min": st.integers(0, 3), "prompt_lookup_max": st.integers(3, 9),
             "model": st.just("") if method != "draft_model" else _user_value(by_key["model"])
             .filter(bool), "disable_by_batch_size": counts,
             "suffix_decoding_max_cached_requests": counts,
             "suffix_decoding_min_token_prob": st.floats(0, 1)})
    methods = [m for m in by_key["method"].meta.choices if m]
    return st.one_of(st.just({}), st.sampled_from(methods).flatmap(with_method))


GROUPS = setting_groups(cli_settings())
PLAIN = [s for s in cli_settings() if s.group is None]


def _flags(values: dict) -> list[str]:
    argv = [f"--{g.replace('_', '-')}={json.dumps(values[g])}" for g in GROUPS]
    for s in PLAIN:
        value = values[s.arg]
        if s.type is bool:
            argv.append(s.flag if value else f"--no-{s.flag[2:]}")
        else:
            argv.append(f"{s.flag}={value!r}" if isinstance(value, float) else f"{s.flag}={value}")
    return argv


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({**{s.arg: _user_value(s) for s in PLAIN},
                              **{g: _valid_group(m) for g, m in GROUPS.items()}}))
def test_flags_config_argv_config_round_trip_every_field(values):
    parser = _parser()
    config = engine_config_from_args(parser.parse_args(_flags(values)))
    for s in cli_settings():
        given = values[s.group].get(s.arg, s.default) if s.group else values[s.arg]
        assert getattr(getattr(config, s.section), s.name) == s.to_config(given), s.arg
    assert engine_config_from_args(parser.parse_args(engine_args_to_argv(config))) == config


def test_flag_spellings_of_vllm_and_of_earlier_llmserve():
    parser = _parser()
    config = engine_config_from_args(parser.parse_args([
        "--no-prefix-caching", "-tp", "2", "--attention-backend", "torch_sdpa",
        "--kv-cache-dtype", "", "--dtype", "half", "--no-async-scheduling"]))
    assert not config.cache.enable_prefix_caching and config.parallel.tensor_parallel_size == 2
    assert config.model.attention_backend == "cpu_paged" and config.model.dtype == "float16"
    assert config.cache.kv_cache_dtype == "auto" and not config.scheduler.async_scheduling
    assert engine_config_from_args(parser.parse_args(
        ["--attention-backend", "FLASH_ATTN"])).model.attention_backend == "flash_attn"
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_a_vllm_flag_llmserve_lacks_is_named_as_such(capsys):
    for argv, said in [(["--quantization", "fp8"], "--quantization: 'quantization' is a vLLM "
                        "engine argument that llmserve does not support"),
                       (["--no-enable-chunked-prefill"], "'enable_chunked_prefill' is a vLLM"),
                       (["--max-model-lne", "3"], "unrecognized arguments: --max-model-lne 3")]:
        parser = argparse.ArgumentParser(prog="llmserve serve")
        add_engine_args(parser)
        with pytest.raises(SystemExit) as exit_info:
            parse_args_refusing_vllm_flags(parser, argv)
        assert exit_info.value.code == 2
        assert said in capsys.readouterr().err


# ---- config -> proto -> config ---------------------------------------------------------

def test_proto_messages_mirror_the_config_dataclasses_field_for_field():
    sections = typing.get_type_hints(EngineConfig)
    assert {f.name for f in config_pb2.EngineConfig.DESCRIPTOR.fields} == set(sections)
    for name, cls in sections.items():
        message = config_pb2.EngineConfig.DESCRIPTOR.fields_by_name[name].message_type
        assert message.name == cls.__name__
        hints = typing.get_type_hints(cls)
        assert set(message.fields_by_name) == set(hints), name
        for field_name, pb_field in message.fields_by_name.items():
            assert pb_field.type == _PROTO_TYPES[hints[field_name]], f"{name}.{field_name}"


def _config_value(s):
    if s.meta.choices:
        return st.sampled_from(s.meta.choices)
    return {bool: st.booleans(), int: st.integers(-2 ** 63, 2 ** 63 - 1),
            float: st.floats(allow_nan=False),
            str: st.text(st.characters(blacklist_categories=("Cs",)))}[s.type]


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({(s.section, s.name): _config_value(s) for s in SETTINGS}))
def test_config_proto_config_round_trips_every_field(values):
    config = EngineConfig()
    for (section, name), value in values.items():
        setattr(getattr(config, section), name, value)
    assert convert.engine_config_from_proto(convert.engine_config_to_proto(config)) == config


# ---- EngineArgs and LLM(...) ------------------------------------------------------------

def test_engine_args_has_a_field_per_offline_setting_under_its_user_name():
    offline = [s for s in SETTINGS if OFFLINE in s.meta.scopes]
    assert [f.name for f in dataclasses.fields(EngineArgs)] == \
        [s.arg for s in offline if s.group is None] + list(setting_groups(offline))
    assert EngineArgs().create_engine_config().scheduler.max_step_tokens_while_decoding == 0
    for s in offline:
        assert s.arg in EngineArgs.__doc__ and s.meta.help in EngineArgs.__doc__


def test_engine_args_take_the_vllm_arguments_the_server_flags_have():
    config = EngineArgs(gpu_memory_utilization=0.5, enforce_eager=True, tensor_parallel_size=1,
                        attention_backend="CPU_ATTN", async_scheduling=False,
                        scheduling_policy="priority", kv_cache_dtype="bfloat16",
                        kv_cache_gib=0.25).create_engine_config()
    assert config.cache.gpu_memory_utilization == 0.5 and config.model.enforce_eager
    assert config.model.attention_backend == "cpu_paged" and not config.scheduler.async_scheduling
    assert config.scheduler.policy == "priority" and config.cache.kv_cache_bytes == 1 << 28
    assert dataclasses.replace(EngineArgs(), max_model_len=64).max_model_len == 64


@pytest.mark.parametrize("name", sorted(VLLM_ENGINE_ARGS - {s.group or s.arg for s in SETTINGS}
                                        - TRANSLATED_ARGS))
def test_a_vllm_argument_llmserve_lacks_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"'{name}' is a vLLM engine argument that llmserve "
                                         "does not support"):
        EngineArgs(**{name: None})


def test_bad_values_and_unknown_names_are_refused_with_what_to_change():
    for kwargs, error, said in [
            ({"max_model_lne": 3}, TypeError, "did you mean 'max_model_len'"),
            ({"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype must be one of 'auto', "
                                                    "'bfloat16', 'float16'; got 'fp8'"),
            ({"max_num_seqs": "8"}, ValueError, "max_num_seqs takes an int; got '8'"),
            ({"enforce_eager": 1}, ValueError, "enforce_eager takes a bool"),
            ({"distributed_init_method": "tcp://x:1"}, TypeError, "no argument")]:
        with pytest.raises(error, match=said):
            EngineArgs(**kwargs)


def test_llm_refuses_a_vllm_argument_before_loading_anything():
    with pytest.raises(ValueError, match="'quantization' is a vLLM engine argument"):
        LLM("no-such-model", quantization="fp8")


# ---- speculative_config: vLLM's dict argument -------------------------------------------

def test_speculative_config_is_one_dict_argument_and_one_json_flag():
    config = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 4}).create_engine_config()
    spec = config.speculative
    assert (spec.method, spec.num_tokens, spec.lookup_range) == ("ngram", 3, (4, 4))
    assert EngineArgs().create_engine_config().speculative.enabled is False
    parser = _parser()
    config = engine_config_from_args(parser.parse_args(
        ["--speculative-config", '{"method": "draft_model", "model": "tiny-draft"}']))
    assert (config.speculative.model, config.speculative.num_tokens) == ("tiny-draft", 4)
    assert engine_config_from_args(parser.parse_args(engine_args_to_argv(config))) == config


@pytest.mark.parametrize("value, said", [
    ({"methd": "ngram"}, "speculative_config has no key 'methd'; did you mean 'method'?"),
    ({"method": "eagle"}, "speculative_config.method must be one of"),
    ({"num_speculative_tokens": 4}, "speculative_config needs a method"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0"),
    ({"method": "ngram", "prompt_lookup_min": 6, "prompt_lookup_max": 3},
     r"prompt_lookup_min \(6\) must be <= prompt_lookup_max \(3\)"),
    ({"method": "draft_model"}, "model names the draft model"),
    ({"method": "ngram", "model": "x"}, "only method 'draft_model' takes one"),
    ({"method": "ngram", "num_speculative_tokens": "4"},
     "speculative_config.num_speculative_tokens takes an int"),
    ("ngram", "speculative_config takes a dict")])
def test_a_bad_speculative_config_is_refused_naming_the_key(value, said):
    with pytest.raises(ValueError, match=said):
        EngineArgs(speculative_config=value)
