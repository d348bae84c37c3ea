"""The model protocols are checked at runtime: the Llama Transformer offers pipeline splitting and context
parallel buffers, a plain module neither."""

import torch
from torch import nn

from titan.models.llama3 import Transformer, llama3_flavors
from titan.protocols.model import ContextParallelModel, PipelineModel, TrainableModel


def test_the_llama_transformer_satisfies_every_protocol():
    with torch.device("meta"):
        model = Transformer(llama3_flavors["debug"])
    assert isinstance(model, TrainableModel) and isinstance(model, PipelineModel)
    assert isinstance(model, ContextParallelModel) and model.context_parallel_buffers == ("rope_cache",)
    assert all(hasattr(model, name) for name in model.pipeline_first_modules + model.pipeline_last_modules)


def test_a_plain_module_satisfies_none():
    assert not any(isinstance(nn.Linear(2, 2), p) for p in (TrainableModel, PipelineModel, ContextParallelModel))
