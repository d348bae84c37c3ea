"""The model registry: titan's built-in models, and the specs other packages register when imported.

A config names a model by `model.name`; a model of another package (lcsm, morphens) is found through
`model.spec = "package.module"`, whose import registers it, so that titan never imports those packages.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from typing import Any, Literal

from titan.protocols.model_spec import ModelSpec
from titan.tools.cli import UserError

# name -> the module whose import registers it; imported on first use, so `import titan` stays light.
BUILTIN_MODELS = {"llama3": "titan.models.llama3", "qwen3": "titan.models.qwen3", "qwen3_moe": "titan.models.qwen3_moe",
                  "deepseek_v3": "titan.models.deepseek_v3"}

_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Adds a spec under its name and returns it; a second spec under a taken name is an error."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise UserError(f"a model named {spec.name!r} is already registered; give the new ModelSpec another name")
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str, spec_module: str = "") -> ModelSpec:
    """Looks a spec up by name, importing `spec_module` (or the built-in model's module) first."""
    module = spec_module or BUILTIN_MODELS.get(name)
    if module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UserError(f"model.spec: cannot import {module!r} ({e}); give an importable module") from e
    if name not in _REGISTRY:
        known = ", ".join(sorted({*_REGISTRY, *BUILTIN_MODELS}))
        raise UserError(
            f"model.name: unknown model {name!r}; known: {known} "
            "(a model from another package needs model.spec = 'package.module')"
        )
    return _REGISTRY[name]


def _settable(tp: Any) -> Any:
    """The config type of an args field: `X | None` as X, a list of settable values (e.g. Qwen3-MoE's
    mlp_only_layers, `--model.mlp_only_layers 0,3`); None for a type no config value can give."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = arms[0] if len(arms) == 1 else None
    if tp in (bool, int, float, str) or typing.get_origin(tp) is Literal:
        return tp
    if typing.get_origin(tp) is list and _settable(typing.get_args(tp)[0]) is not None:
        return tp
    return None


def model_arg_overrides(name: str, spec_module: str, given: dict[str, Any]) -> dict[str, Any]:
    """`--model.<field>` keys checked against the family's args dataclass and converted to its field types (a
    command-line string is parsed, a file's value type-checked); one line for a key the family lacks."""
    from titan.config.manager import ConfigError, check_toml_value, describe_type, from_string

    spec = get_model_spec(name, spec_module)
    args_type = type(next(iter(spec.flavors.values()), None))
    if not dataclasses.is_dataclass(args_type):
        raise ConfigError(f"model.{next(iter(given))}: model {name} has no architecture fields to set")
    hints = typing.get_type_hints(args_type)
    fields = [f.name for f in dataclasses.fields(args_type) if f.init]
    out = {}
    for key, value in given.items():
        if key not in fields:
            raise ConfigError(f"unknown key model.{key}: model {name} has no such field; its architecture fields: "
                              f"{', '.join(fields)} (or [model] keys: see --help)")
        tp = _settable(hints[key])
        if tp is None:
            raise ConfigError(f"model.{key} of {name} cannot be set from a config; use another flavor")
        try:
            out[key] = from_string(tp, value) if isinstance(value, str) and tp is not str else check_toml_value(
                tp, value)
        except (ValueError, TypeError):
            raise ConfigError(f"model.{key} must be {describe_type(tp)}, got {value!r}") from None
    return out
