"""EngineArgs: the offline API's engine settings (vLLM's EngineArgs, with the
arguments llmserve has), one field per setting declared in
services/common/config.py, under the name users give it there.

`EngineArgs(**kwargs)` and `LLM(model, **kwargs)` take vLLM's names with vLLM's
meanings; a vLLM argument llmserve does not have is refused by name (ValueError),
and a name neither knows is a TypeError, as for any Python call.
"""
from __future__ import annotations

import dataclasses

from services.common.config import EngineConfig
from services.common.setting import (OFFLINE, build_config, close_matches, declared_settings,
                                     setting_groups)
from services.common.vllm_names import unsupported_vllm_argument

_SETTINGS = [s for s in declared_settings(EngineConfig) if OFFLINE in s.meta.scopes]
# Settings given as keys of a dict argument (vLLM's speculative_config), by its name.
_GROUPS = setting_groups(_SETTINGS)


def _docstring() -> str:
    lines = [f"    {s.arg} ({s.user_type.__name__}, default {s.user_default(OFFLINE)!r}): "
             f"{s.meta.help}" for s in _SETTINGS if s.group is None]
    for group, members in _GROUPS.items():
        lines.append(f"    {group} (dict, default None): keys " + "; ".join(
            f"{s.arg} ({s.user_type.__name__}, default {s.user_default(OFFLINE)!r}): "
            f"{s.meta.help}" for s in members))
    return "vLLM-style engine arguments; create_engine_config() builds the config.\n\n" \
        + "\n".join(lines)


def _create_engine_config(self) -> EngineConfig:
    return build_config(EngineConfig, dataclasses.asdict(self))


def _validate(self) -> None:
    """Every value checked now, so that a bad one fails where it was given."""
    self.create_engine_config()


_EngineArgsFields = dataclasses.make_dataclass(
    "EngineArgs",
    [(s.arg, s.user_type, dataclasses.field(default=s.user_default(OFFLINE)))
     for s in _SETTINGS if s.group is None]
    + [(group, dict | None, dataclasses.field(default=None)) for group in _GROUPS],
    namespace={"create_engine_config": _create_engine_config, "__post_init__": _validate,
               "__doc__": _docstring()})


class EngineArgs(_EngineArgsFields):
    __doc__ = _EngineArgsFields.__doc__

    def __init__(self, *args, **kwargs):
        if "pooler_config" in kwargs:  # one of TRANSLATED_ARGS
            kwargs.update(pooler_settings(kwargs.pop("pooler_config")))
        check_engine_arg_names(kwargs)
        super().__init__(*args, **kwargs)


# vLLM arguments EngineArgs takes and turns into settings of other names.
TRANSLATED_ARGS = frozenset({"pooler_config"})
# vLLM's PoolerConfig fields -> the settings that hold them here.
_POOLER_FIELDS = {"pooling_type": "pooling_type", "normalize": "pooling_normalize"}


def pooler_settings(pooler_config) -> dict:
    """vLLM's `pooler_config` (a dict, or an object with its fields) as llmserve's
    pooling_type and pooling_normalize settings; a field llmserve lacks is refused."""
    if pooler_config is None:
        return {}
    fields = pooler_config if isinstance(pooler_config, dict) else {
        k: v for k, v in vars(pooler_config).items() if v is not None}
    unknown = sorted(set(fields) - set(_POOLER_FIELDS))
    if unknown:
        raise ValueError(f"pooler_config: llmserve supports {sorted(_POOLER_FIELDS)}, not "
                         f"{unknown}")
    return {_POOLER_FIELDS[k]: v for k, v in fields.items()}


def check_engine_arg_names(kwargs: dict) -> None:
    """ValueError for a vLLM argument llmserve lacks, TypeError for any other
    unknown name."""
    known = {s.arg for s in _SETTINGS if s.group is None} | set(_GROUPS)
    for name in kwargs:
        if name in known:
            continue
        message = unsupported_vllm_argument(name)
        if message:
            raise ValueError(message)
        raise TypeError(f"EngineArgs has no argument {name!r}{close_matches(name, known)}")
