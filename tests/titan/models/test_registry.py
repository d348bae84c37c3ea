"""The model registry: built-in models by name, others through their package's import, one spec per name."""

import dataclasses

import pytest

from titan.models import get_model_spec, register_model_spec


def test_a_builtin_model_is_found_by_name_alone():
    assert get_model_spec("llama3").name == "llama3"


def test_a_second_spec_under_a_taken_name_is_refused():
    clone = dataclasses.replace(get_model_spec("llama3"))
    with pytest.raises(ValueError, match="a model named 'llama3' is already registered"):
        register_model_spec(clone)
    assert register_model_spec(get_model_spec("llama3")) is get_model_spec("llama3"), "the same spec again is fine"


def test_an_unknown_name_lists_the_known_models_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown model 'gpt2'; known: .*llama3.*model.spec = 'package.module'"):
        get_model_spec("gpt2")


def test_a_spec_module_that_does_not_import_is_named():
    with pytest.raises(ValueError, match="model.spec: cannot import 'no_such_package.models'"):
        get_model_spec("x", "no_such_package.models")
