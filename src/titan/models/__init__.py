"""The model registry: titan's built-in models, and the specs other packages register when imported.

A config names a model by `model.name`; a model of another package (lcsm, morphens) is found through
`model.spec = "package.module"`, whose import registers it, so that titan never imports those packages.
"""

from __future__ import annotations

import importlib

from titan.protocols.model_spec import ModelSpec
from titan.tools.cli import UserError

# name -> the module whose import registers it; imported on first use, so `import titan` stays light.
BUILTIN_MODELS = {"llama3": "titan.models.llama3", "qwen3": "titan.models.qwen3"}

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
