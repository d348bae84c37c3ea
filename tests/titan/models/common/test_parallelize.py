"""The decoder's layout rules refuse what its parallelization cannot shard (tied embeddings under TP/PP, heads TP
does not divide) naming the fix; on one rank it applies only what the config
asks (here: checkpointing)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from titan.config import parse_args
from titan.models.common.parallelize import check_decoder_layout, parallelize_decoder
from titan.models.deepseek_v3 import deepseek_v3_flavors
from titan.models.llama3 import Transformer, llama3_flavors
from titan.tools.cli import UserError


def dims(tp=1, pp=1):
    return SimpleNamespace(tp=tp, tp_enabled=tp > 1, pp_enabled=pp > 1, fsdp_enabled=False, dp_replicate_enabled=False)


def meta_model(**changes):
    with torch.device("meta"):
        return Transformer(dataclasses.replace(llama3_flavors["debug"], n_layers=2, **changes))


@pytest.mark.parametrize("layout", [dims(tp=2), dims(pp=2)], ids=["tp", "pp"])
def test_tied_embeddings_under_tensor_or_pipeline_parallel_are_refused(layout):
    with pytest.raises(UserError, match="tied embeddings .* drop tensor/pipeline parallel or pass --model."
                                        "tie_embeddings false"):
        check_decoder_layout(meta_model(tie_embeddings=True).args, layout, parse_args([]))


def test_a_tp_degree_that_does_not_divide_the_kv_heads_is_refused():
    with pytest.raises(UserError, match="tensor_parallel_degree 8 must divide n_heads 16 and n_kv_heads 4"):
        check_decoder_layout(meta_model().args, dims(tp=8), parse_args([]))


def test_one_rank_gets_only_the_checkpointing_it_asked_for():
    model = meta_model()
    assert parallelize_decoder(model, dims(), parse_args(["--activation_checkpoint.mode", "full"])) is model
    assert all(isinstance(block, CheckpointWrapper) for block in model.layers.values())
    assert all(type(p) is nn.Parameter for p in model.parameters())  # no DTensor: neither TP nor FSDP


def test_the_sparse_decoders_take_every_layout_and_option_their_heads_allow():
    args = deepseek_v3_flavors["debug"]
    options = parse_args(["--compile.enable", "--float8.enable"])
    check_decoder_layout(args, SimpleNamespace(**vars(dims(tp=2, pp=2)), cp_enabled=True), options)
    with pytest.raises(UserError, match=f"tensor_parallel_degree 3 must divide n_heads {args.n_heads}$"):
        check_decoder_layout(args, dims(tp=3), options)
