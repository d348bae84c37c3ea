"""Builds a JobConfig from defaults, a TOML file and `--section.key value` overrides, in that order."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal

import tomli

from titan.config.job_config import JobConfig
from titan.tools.cli import UserError


class ConfigError(UserError):
    """A user mistake in the configuration; its message is one line naming the key and the fix."""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def describe_type(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list, each {describe_type(typing.get_args(tp)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def _parse_scalar(tp: Any, raw: str) -> Any:
    if tp is bool:
        low = raw.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ValueError
    if tp is int:
        return int(raw)
    if tp is float:
        value = float(raw)
        if math.isnan(value):  # every comparison with NaN is false, so no range check would catch it
            raise ValueError
        return value
    return raw


def from_string(tp: Any, raw: str) -> Any:
    """Converts a command-line string to the field's type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if raw == str(choice):
                return choice
        raise ValueError
    if origin is list:
        (elem,) = typing.get_args(tp)
        text = raw.strip().strip("[]")
        return [from_string(elem, item.strip().strip("'\"")) for item in text.split(",") if item.strip()]
    return _parse_scalar(tp, raw)


def check_toml_value(tp: Any, value: Any) -> Any:
    """Checks a TOML value against the field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(typing.get_args(tp)[0]):
            return value
        raise ValueError
    if origin is list:
        (elem,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError
        return [check_toml_value(elem, v) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float) and math.isnan(value):
        raise ValueError
    if type(value) is not tp:
        raise ValueError
    return value


def _assign(values: dict[str, dict[str, Any]], section: str, key: str, value: Any, from_cli: bool) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}]; known sections: {', '.join(sections)}")
    hints = typing.get_type_hints(sections[section])
    if key not in hints:
        raise ConfigError(
            f"unknown key {section}.{key}; keys of [{section}]: {', '.join(hints)} (see --help)"
        )
    tp = hints[key]
    try:
        converted = from_string(tp, value) if from_cli else check_toml_value(tp, value)
    except (ValueError, TypeError):
        raise ConfigError(f"{section}.{key} must be {describe_type(tp)}, got {value!r}") from None
    values.setdefault(section, {})[key] = converted


def _read_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist; pass --config with a path to a .toml file")
    try:
        with p.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None


def build_job_config(values: dict[str, dict[str, Any]]) -> JobConfig:
    """Instantiates every section, turning validation errors into ConfigError."""
    kwargs = {}
    for name, cls in _sections().items():
        try:
            kwargs[name] = cls(**values.get(name, {}))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return JobConfig(**kwargs)


def help_text() -> str:
    lines = [
        "usage: python -m titan.train [--config PATH.toml] [--section.key VALUE ...]",
        "",
        "Values come from the defaults, then the TOML file, then command-line overrides.",
    ]
    for section, cls in _sections().items():
        lines.append(f"\n[{section}]")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{section}.{f.name} ({describe_type(hints[f.name])}, default {default!r})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


def split_cli(argv: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """`[--config PATH] [--name value | --name=value | --bool.flag]...` -> (config path, [(name, raw value)])."""
    overrides: list[tuple[str, str]] = []
    config_path = ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        name, eq, raw = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            is_flag = nxt is None or nxt.startswith("--")
            raw = "true" if is_flag else nxt
            i += 1 if is_flag else 2
        else:
            i += 1
        if name in ("config", "job.config_file"):
            config_path = raw
        else:
            overrides.append((name, raw))
    return config_path, overrides


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Parses `[--config PATH] [--section.key value | --section.key=value | --bool.flag]...`."""
    config_path, overrides = split_cli(list(argv or []))
    values: dict[str, dict[str, Any]] = {}
    if config_path:
        for section, table in _read_toml(config_path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{config_path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _assign(values, section, key, value, from_cli=False)
    for name, raw in overrides:
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"option --{name} must look like --section.key (see --help)")
        _assign(values, section, key, raw, from_cli=True)
    return build_job_config(values)


def to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)


def to_toml(config: JobConfig) -> str:
    """Serializes a JobConfig as TOML that parse_args reads back to an equal config."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    out = []
    for section, table in to_dict(config).items():
        out.append(f"[{section}]")
        out.extend(f"{k} = {fmt(v)}" for k, v in table.items())
        out.append("")
    return "\n".join(out)
