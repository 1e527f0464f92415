"""The engine's command-line flags, generated from the config dataclasses.

Each engine option is written once, as a field of dspark/config.py with its default and help;
`add_engine_flags` turns the fields into argparse flags and `engine_config_from_args` turns the
parsed flags back into an EngineConfig, so a flag cannot drift from the field it sets. Every
`dspark` command that starts an engine calls `add_engine_flags` exactly once.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any

from dspark.config import EngineConfig


@dataclass(frozen=True)
class EngineFlag:
    """One leaf field of EngineConfig (top level or a section) and the flag that sets it."""
    section: str | None               # None: a field of EngineConfig itself
    field: dataclasses.Field
    kind: type                        # the annotation without its `| None`

    @property
    def name(self) -> str:
        return self.field.metadata.get("name") or "--" + self.field.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """Where argparse puts the value, named after the flag as argparse names it: the
        harnesses read the flags by those names (args.threads, args.dp)."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def none_dest(self) -> str | None:
        """The --no-NAME switch's attribute, for fields that have one."""
        return "no_" + self.dest if "none_help" in self.field.metadata else None


def engine_flags() -> list[EngineFlag]:
    """Every leaf field of EngineConfig, in declaration order (sections after the top level)."""
    flags = _leaves(EngineConfig, None)
    for f in dataclasses.fields(EngineConfig):
        section = _section_class(f)
        if section is not None:
            flags += _leaves(section, f.name)
    return flags


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine flags, one argument group per config section, on `parser`."""
    groups: dict[str | None, Any] = {}
    for flag in engine_flags():
        if flag.section not in groups:
            title = "engine" if flag.section is None else f"engine ({flag.section})"
            groups[flag.section] = parser.add_argument_group(title)
        _add_flag(groups[flag.section], flag)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags in `args` describe (validated by the dataclasses)."""
    values = vars(args)
    picked: dict[str | None, dict[str, Any]] = {}
    for flag in engine_flags():
        value = values[flag.dest]
        if flag.none_dest is not None and values[flag.none_dest]:
            value = None
        picked.setdefault(flag.section, {})[flag.field.name] = value
    sections = {f.name: _section_class(f)(**picked[f.name])
                for f in dataclasses.fields(EngineConfig) if _section_class(f) is not None}
    return EngineConfig(**picked[None], **sections)


def _leaves(cls: type, section: str | None) -> list[EngineFlag]:
    hints = typing.get_type_hints(cls)
    return [EngineFlag(section, f, _strip_none(hints[f.name])) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(hints[f.name])]


def _section_class(f: dataclasses.Field) -> type | None:
    """The config class of a section field of EngineConfig (cache, spec, ...), else None."""
    kind = typing.get_type_hints(EngineConfig)[f.name]
    return kind if dataclasses.is_dataclass(kind) else None


def _strip_none(kind: Any) -> type:
    """`int | None` -> int: a flag converts its text to the type it sets when one is given."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
    return kind


def _add_flag(group: Any, flag: EngineFlag) -> None:
    meta = flag.field.metadata
    help_text = meta.get("help", "").replace("%", "%%")         # argparse %-formats help strings
    if flag.kind is bool:                               # off by default, on when given
        group.add_argument(flag.name, action="store_true", help=help_text)
    else:
        typed = {} if flag.kind is str else {"type": flag.kind}
        group.add_argument(flag.name, default=flag.field.default, choices=meta.get("choices"),
                           help=help_text, **typed)
    if flag.none_dest is not None:
        group.add_argument("--no-" + flag.name.lstrip("-"), dest=flag.none_dest, action="store_true",
                           help=meta["none_help"])


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags that reproduce `args`' engine options in another `dspark` process (the
    inverse of `engine_config_from_args`): the fields that differ from their defaults."""
    values, argv = vars(args), []
    for flag in engine_flags():
        if flag.none_dest is not None and values[flag.none_dest]:
            argv.append("--no-" + flag.name.lstrip("-"))
            continue
        value = values[flag.dest]
        if flag.kind is bool:
            argv += [flag.name] if value else []
        elif value is not None and value != flag.field.default:
            argv += [flag.name, str(value)]
    return argv
