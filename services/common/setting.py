"""A setting: one field of a layer's config dataclass (services/common/config.py),
declared once, with its type (the annotation), default, help text and whether
vLLM has it under the same name with the same meaning.

Everything else is derived from these declarations: the command-line flags and
the argv that rebuilds a config in a child process (config_cli.py), the
offline API's EngineArgs (llmserve/engine_args.py), and the proto conversion
(convert.py, checked field by field by tests/unit/test_config_sources.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Mapping

# Where a setting shows.
CLI = "cli"  # a flag of `llmserve serve` and `llmserve engine-core`
OFFLINE = "offline"  # a keyword of EngineArgs and LLM(...)

_SAME = object()  # offline_default: as the server's default


@dataclass(frozen=True)
class Setting:
    """What `setting()` declares; kept in the dataclass field's metadata."""

    help: str
    # Whether `arg` is also one of vLLM's engine arguments, with vLLM's meaning.
    vllm: bool
    # The name users give it (EngineArgs keyword, --flag): the field's own when None.
    arg: str | None
    choices: tuple[str, ...]
    # Other spellings of a value (an old name, vLLM's): alias -> canonical value.
    value_aliases: Mapping[str, str]
    # config value = user value * scale (a GiB flag for a field in bytes).
    scale: int
    # EngineArgs' default where the offline API's differs from the server's.
    offline_default: Any
    scopes: frozenset[str]
    # More flag spellings; for a bool, one starting with --no- turns it off.
    flag_aliases: tuple[str, ...]
    # The dict argument whose key it is, as vLLM's speculative_config holds
    # "method" and the rest (one --flag of JSON, one EngineArgs dict); None: an
    # argument of its own.
    group: str | None


def setting(default, help: str, *, vllm: bool = False, arg: str | None = None,
            choices: tuple[str, ...] = (), value_aliases: Mapping[str, str] | None = None,
            scale: int = 1, offline_default=_SAME, scopes=(CLI, OFFLINE),
            flag_aliases: tuple[str, ...] = (), group: str | None = None):
    """A config dataclass field that is a user-facing setting."""
    meta = Setting(help, vllm, arg, tuple(choices), MappingProxyType(dict(value_aliases or {})),
                   scale, offline_default, frozenset(scopes), tuple(flag_aliases), group)
    return field(default=default, metadata={"setting": meta})


@dataclass(frozen=True)
class DeclaredSetting:
    """A setting with where it lives: EngineConfig.<section>.<name>."""

    section: str
    name: str
    type: type  # of the config field: bool, int, float or str
    default: Any
    meta: Setting

    @property
    def arg(self) -> str:
        return self.meta.arg or self.name

    @property
    def flag(self) -> str:
        return "--" + self.arg.replace("_", "-")

    @property
    def group(self) -> str | None:
        return self.meta.group

    @property
    def user_type(self) -> type:
        """The type users give: a scaled int is given as a float (GiB for bytes)."""
        return float if self.meta.scale != 1 else self.type

    def user_default(self, scope: str) -> Any:
        if scope == OFFLINE and self.meta.offline_default is not _SAME:
            return self.meta.offline_default
        return self.to_user(self.default)

    def to_user(self, config_value: Any) -> Any:
        return config_value / self.meta.scale if self.meta.scale != 1 else config_value

    def to_config(self, user_value: Any) -> Any:
        """The config value for what a user gave; ValueError naming the setting
        when it has the wrong type or is not one of the choices."""
        value = self.meta.value_aliases.get(user_value, user_value) \
            if isinstance(user_value, str) else user_value
        name = f"{self.group}.{self.arg}" if self.group else self.arg
        _check_type(name, value, self.user_type)
        if self.meta.choices and value not in self.meta.choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, self.meta.choices))}; "
                             f"got {user_value!r}")
        if self.meta.scale != 1:
            return int(value * self.meta.scale)
        return float(value) if self.type is float else value


# A user value's type check, and what the error calls the type. bool is an int
# to Python, but not a valid number of anything here.
_TYPES = {
    bool: (lambda v: isinstance(v, bool), "a bool (True or False)"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _check_type(arg: str, value: Any, expected: type) -> None:
    accepts, noun = _TYPES[expected]
    if not accepts(value):
        raise ValueError(f"{arg} takes {noun}; got {value!r}")


def declared_settings(config_cls: type) -> Iterator[DeclaredSetting]:
    """The settings of a config made of sections (EngineConfig), in declaration
    order: every field of every section dataclass that setting() declared."""
    for section in dataclasses.fields(config_cls):
        section_cls = typing.get_type_hints(config_cls)[section.name]
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            meta = f.metadata.get("setting")
            if meta is not None:
                yield DeclaredSetting(section.name, f.name, hints[f.name], f.default, meta)


def setting_groups(settings: list[DeclaredSetting]) -> dict[str, list[DeclaredSetting]]:
    """The settings given as keys of one dict argument, by its name."""
    groups: dict[str, list[DeclaredSetting]] = {}
    for s in settings:
        if s.group is not None:
            groups.setdefault(s.group, []).append(s)
    return groups


def build_config(config_cls: type, user_values: Mapping[str, Any]):
    """config_cls (EngineConfig) from user values by setting arg name (a grouped
    setting's under its group's name, a dict); the others take their defaults."""
    settings = list(declared_settings(config_cls))
    given = dict(user_values)
    for group, members in setting_groups(settings).items():
        given.update(_group_values(group, given.pop(group, None), members))
    sections: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(config_cls)}
    for s in settings:
        key = (s.group, s.arg) if s.group else s.arg
        if key in given:
            sections[s.section][s.name] = s.to_config(given[key])
    hints = typing.get_type_hints(config_cls)
    config = config_cls(**{name: hints[name](**values) for name, values in sections.items()})
    for name in sections:  # a section may check how its values go together
        check = getattr(getattr(config, name), "check", None)
        if check is not None:
            check()
    return config


def _group_values(group: str, value: Any, members: list[DeclaredSetting]) -> dict:
    """A group's dict as {(group, key): value}; ValueError for a key it lacks."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{group} takes a dict (JSON object); got {value!r}")
    keys = {s.arg for s in members}
    for key in value:
        if key not in keys:
            raise ValueError(f"{group} has no key {key!r}{close_matches(str(key), keys)} "
                             f"(its keys: {', '.join(sorted(keys))})")
    return {(group, key): v for key, v in value.items()}


def close_matches(name: str, known) -> str:
    """ "; did you mean 'x'?" when a known name is close, else ""."""
    matches = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {matches[0]!r}?" if matches else ""
