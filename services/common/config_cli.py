"""The engine settings as command-line flags, derived from their declarations
(config.py): the flags, the config they parse into, and the argv that rebuilds
a config in a child process."""
from __future__ import annotations

import argparse
import json
from typing import Any

from services.common.config import EngineConfig
from services.common.setting import (CLI, DeclaredSetting, build_config, declared_settings,
                                     setting_groups)
from services.common.vllm_names import unsupported_vllm_argument


def cli_settings() -> list[DeclaredSetting]:
    return [s for s in declared_settings(EngineConfig) if CLI in s.meta.scopes]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag per engine setting, and one per group of them (a JSON object); read
    back with engine_config_from_args."""
    for s in cli_settings():
        if s.group is None:
            add_setting_flag(parser, s)
    for group, members in setting_groups(cli_settings()).items():
        keys = "; ".join(f"{s.arg}: {s.meta.help} (default: {_shown(s.user_default(CLI))})"
                         for s in members)
        parser.add_argument("--" + group.replace("_", "-"), dest=group, default=None,
                            type=_json_object, metavar="JSON", help=f"a JSON object. {keys}")


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """--model alone (the frontend reads the model's tokenizer)."""
    add_setting_flag(parser, next(s for s in cli_settings() if s.arg == "model"))


def add_setting_flag(parser: argparse.ArgumentParser, s: DeclaredSetting) -> None:
    default = s.user_default(CLI)
    help_text = f"{s.meta.help} (default: {_shown(default)})"
    positive = [a for a in s.meta.flag_aliases if not a.startswith("--no-")]
    if s.type is bool:
        parser.add_argument(s.flag, *positive, dest=s.arg, default=default, help=help_text,
                            action=argparse.BooleanOptionalAction)
        for negative in [a for a in s.meta.flag_aliases if a not in positive]:
            parser.add_argument(negative, dest=s.arg, action="store_false",
                                help=f"the same as --no-{s.flag[2:]}")
        return
    parser.add_argument(s.flag, *positive, dest=s.arg, default=default, help=help_text,
                        type=_flag_type(s), choices=s.meta.choices or None)


def _flag_type(s: DeclaredSetting):
    """The flag's type: the setting's, with its value aliases turned into the
    values they stand for."""
    if s.user_type is not str:
        return s.user_type

    def value(text: str) -> str:
        return s.meta.value_aliases.get(text, text)
    value.__name__ = s.arg  # argparse names the type in its errors
    return value


def _shown(default: Any) -> str:
    return repr(default) if default == "" else str(default)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return build_config(EngineConfig, {s.group or s.arg: getattr(args, s.group or s.arg)
                                       for s in cli_settings()})


def engine_args_to_argv(config: EngineConfig) -> list[str]:
    """The flags that rebuild `config` in another process: every setting, given
    explicitly, so that the child's defaults do not matter (--flag=value: a value
    may start with a dash)."""
    argv: list[str] = []
    groups: dict[str, dict] = {}
    for s in cli_settings():
        value = s.to_user(getattr(getattr(config, s.section), s.name))
        if s.group is not None:
            groups.setdefault(s.group, {})[s.arg] = value
        elif s.type is bool:
            argv.append(s.flag if value else f"--no-{s.flag[2:]}")
        else:
            argv.append(f"{s.flag}={repr(value) if isinstance(value, float) else value}")
    argv += [f"--{group.replace('_', '-')}={json.dumps(values)}"
             for group, values in groups.items()]
    return argv


def parse_args_refusing_vllm_flags(parser: argparse.ArgumentParser,
                                   argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args, except that a vLLM flag llmserve lacks is named as such
    (argparse would only call it unrecognized)."""
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            # --no-x turns off vLLM's boolean x.
            message = (unsupported_vllm_argument(name)
                       or unsupported_vllm_argument(name.removeprefix("no_")))
            if message:
                parser.error(f"{token.split('=', 1)[0]}: {message}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args
