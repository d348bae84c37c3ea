"""The config import path `model.spec = "lcsm.hyena"`: importing it registers the `hyena` ModelSpec."""

from lcsm.model.spec import hyena_flavors, hyena_spec

__all__ = ["hyena_flavors", "hyena_spec"]
