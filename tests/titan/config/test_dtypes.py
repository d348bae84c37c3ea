"""The dtype names of the config mean these torch dtypes, and every name the config accepts has one."""

import typing

import torch

from titan.config.dtypes import TORCH_DTYPES
from titan.config.job_config import Checkpoint, Training


def test_each_name_is_the_torch_dtype_of_that_name():
    assert TORCH_DTYPES == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert [TORCH_DTYPES[n].itemsize for n in ("float32", "bfloat16", "float16")] == [4, 2, 2]


def test_every_dtype_name_the_config_accepts_is_in_the_table():
    fields = [(Training, "mixed_precision_param"), (Training, "mixed_precision_reduce"), (Checkpoint, "export_dtype")]
    for section, key in fields:
        assert set(typing.get_args(typing.get_type_hints(section)[key])) <= set(TORCH_DTYPES), key
