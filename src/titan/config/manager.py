"""Typed configs from defaults, a file and `--section.key value` overrides, in that order, for any root
dataclass whose fields are section dataclasses (titan's JobConfig, morphens' RunConfig, the estimator's options).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import textwrap
import typing
from collections.abc import Callable, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from titan.compat import tomllib
from titan.tools.cli import UserError

C = TypeVar("C")
# (dotted name, value, from_cli) -> the (section.key, value) pairs to set: spelling translations of a tool.
Translate = Callable[[str, Any, bool], list[tuple[str, Any]]]


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


def _is_table_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp)[0] is dict


def describe_type(tp: Any) -> str:
    if _is_table_list(tp):
        return "a list of tables, set in the config file"
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
    if _is_table_list(tp):
        raise ValueError("a list of tables comes from the config file")
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
        if elem is dict:
            if not all(isinstance(v, dict) for v in value):
                raise ValueError
            return value
        return [check_toml_value(elem, v) for v in value]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float) and math.isnan(value):
        raise ValueError
    if type(value) is not tp:
        raise ValueError
    return value


def _flatten(table: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """TOML subtables ([quantize.linear.float8]) as dotted names."""
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        name = f"{prefix}.{key}"
        out.extend(_flatten(value, name) if isinstance(value, dict) else [(name, value)])
    return out


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


class ConfigManager(Generic[C]):
    """Reads one root config class: `parse_args(argv)` or `load(path, overrides)`; `help_text()`; `to_toml()`.

    A user mistake (unknown section or key, wrong type, a value its section's checks refuse, a missing or
    malformed file) raises ConfigError with one line that names the key and what is allowed.
    """

    def __init__(self, root: type[C], usage: str, translate: Translate | None = None):
        self.root = root
        self.usage = usage
        self.translate = translate

    @cached_property
    def sections(self) -> dict[str, type]:
        hints = typing.get_type_hints(self.root)
        return {f.name: hints[f.name] for f in dataclasses.fields(self.root)}

    def _assign(self, values: dict[str, dict[str, Any]], section: str, key: str, value: Any, from_cli: bool) -> None:
        if section not in self.sections:
            raise ConfigError(f"unknown config section [{section}]; known sections: {', '.join(self.sections)}")
        cls = self.sections[section]
        hints = typing.get_type_hints(cls)
        open_keys = getattr(cls, "OPEN_KEYS", "")
        if open_keys and key not in hints:
            # Another owner's key (the model family's): kept as given, checked and converted by the section.
            values.setdefault(section, {}).setdefault(open_keys, {})[key] = value
            return
        if key not in hints or key == open_keys:
            known = ", ".join(k for k in hints if k != open_keys)
            raise ConfigError(f"unknown key {section}.{key}; keys of [{section}]: {known} (see --help)")
        tp = hints[key]
        try:
            converted = from_string(tp, value) if from_cli else check_toml_value(tp, value)
        except (ValueError, TypeError):
            raise ConfigError(f"{section}.{key} must be {describe_type(tp)}, got {value!r}") from None
        values.setdefault(section, {})[key] = converted

    def assign(self, values: dict[str, dict[str, Any]], name: str, value: Any, from_cli: bool) -> None:
        """Sets `section.key` (a file's subtables give `section.key.sub`, which only a translation can take)."""
        try:
            pairs = self.translate(name, value, from_cli) if self.translate else [(name, value)]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for target, converted in pairs:
            section, dot, key = target.partition(".")
            if not dot:
                raise ConfigError(f"option --{name} must look like --section.key (see --help)")
            self._assign(values, section, key, converted, from_cli)

    @staticmethod
    def read_file(path: str) -> dict[str, Any]:
        """A TOML file, or JSON when the name ends in .json (same sections)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist; pass --config with a path to a .toml file")
        is_json = p.suffix == ".json"
        try:
            if is_json:
                return json.loads(p.read_text())
            with p.open("rb") as f:
                return tomllib.load(f)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid {'JSON' if is_json else 'TOML'}: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path} is not UTF-8 text") from None

    def build(self, values: dict[str, dict[str, Any]]) -> C:
        """Instantiates every section, turning its validation errors into ConfigError."""
        kwargs = {}
        for name, cls in self.sections.items():
            try:
                kwargs[name] = cls(**values.get(name, {}))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return self.root(**kwargs)

    def load(self, path: str = "", overrides: Sequence[tuple[str, Any]] = (), passthrough: Sequence[str] = ()) -> C:
        """Defaults <- the file at `path` <- `[("section.key", "raw value"), ...]`; overrides of the sections in
        `passthrough` are left out (they are another tool's options on the same command line)."""
        values: dict[str, dict[str, Any]] = {}
        if path:
            for section, table in self.read_file(path).items():
                if not isinstance(table, dict):
                    raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
                for name, value in _flatten(table, section):
                    self.assign(values, name, value, from_cli=False)
        for name, raw in overrides:
            if name.partition(".")[0] not in passthrough:
                self.assign(values, name, raw, from_cli=True)
        return self.build(values)

    def parse_args(self, argv: Sequence[str] | None = None, passthrough: Sequence[str] = ()) -> C:
        """Parses `[--config PATH] [--section.key value | --section.key=value | --bool.flag]...`."""
        config_path, overrides = split_cli(list(argv or []))
        return self.load(config_path, overrides, passthrough)

    def help_text(self) -> str:
        """Every `--section.key` with its type, default and docstring."""
        lines = [f"usage: {self.usage}", "",
                 "Values come from the defaults, then the config file, then command-line overrides."]
        for section, cls in self.sections.items():
            lines.append(f"\n[{section}]")
            docs, hints = field_docs(cls), typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if f.name == getattr(cls, "OPEN_KEYS", ""):
                    lines.append(f"  --{section}.<field> (the family's type)\n      {docs.get(f.name, '')}")
                    continue
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                lines.append(f"  --{section}.{f.name} ({describe_type(hints[f.name])}, default {default!r})")
                lines.append(f"      {docs.get(f.name, '')}")
        return "\n".join(lines)

    @staticmethod
    def to_dict(config: C) -> dict[str, dict[str, Any]]:
        """Every section's keys, a section's open keys among its own as they are given."""
        out = {}
        for f in dataclasses.fields(config):
            section = getattr(config, f.name)
            table = dataclasses.asdict(section)
            extra = table.pop(getattr(section, "OPEN_KEYS", ""), {})
            out[f.name] = {**table, **extra}
        return out

    def to_toml(self, config: C) -> str:
        """Serializes a config as TOML that `parse_args` reads back to an equal config."""

        def fmt(v: Any) -> str:
            if isinstance(v, bool):
                return "true" if v else "false"
            if isinstance(v, str):
                return json.dumps(v)
            if isinstance(v, list):
                return "[" + ", ".join(fmt(x) for x in v) + "]"
            if isinstance(v, dict):
                return "{" + ", ".join(f"{json.dumps(k)} = {fmt(x)}" for k, x in v.items()) + "}"
            return repr(v)

        out = []
        for section, table in self.to_dict(config).items():
            out.append(f"[{section}]")
            out.extend(f"{k} = {fmt(v)}" for k, v in table.items())
            out.append("")
        return "\n".join(out)
