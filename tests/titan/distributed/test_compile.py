"""compile.components picks what torch.compile wraps: the transformer blocks ("model") and/or the loss ("loss").

Tolerance: the compiled loss fuses log-softmax and its reductions, so fp32 losses match eager to rtol 1e-5.
"""

import pytest

from tests.titan.conftest import TINY, losses, run_train
from titan.components.loss import cross_entropy_loss
from titan.config.job_config import Compile
from titan.distributed import apply_compile, compile_loss
from titan.models.llama3.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, max_seq_len=64)


@pytest.mark.parametrize("components", [["model"], ["loss"], ["model", "loss"]])
def test_components_choose_the_blocks_and_the_loss(components):
    config = Compile(enable=True, components=components)
    model = Transformer(ARGS)
    apply_compile(model, config)
    compiled_blocks = [type(b).__name__ == "OptimizedModule" for b in model.layers.values()]
    assert compiled_blocks == ["model" in components] * ARGS.n_layers
    assert (compile_loss(cross_entropy_loss, config) is not cross_entropy_loss) == ("loss" in components)
    assert compile_loss(cross_entropy_loss, Compile(enable=False, components=components)) is cross_entropy_loss


def test_the_blocks_dynamo_flag_is_set_while_they_trace_and_nowhere_else():
    """The flag that lets a MoE record its routing under a compiled checkpoint (titan.distributed.compile) holds
    while a block traces, and the process's dynamo config is left as it was, for the compiled loss and others."""
    import torch

    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    seen = []

    def backend(gm, example_inputs):
        seen.append(getattr(torch._dynamo.config, flag))
        return gm.forward

    model = Transformer(ARGS)
    model.init_weights()
    apply_compile(model, Compile(enable=True, components=["model"], backend=backend))
    assert getattr(torch._dynamo.config, flag) is False  # dynamo's default
    model(torch.zeros(1, 8, dtype=torch.long))
    assert seen and all(seen)
    assert getattr(torch._dynamo.config, flag) is False


@pytest.mark.parametrize("components", [[], ["graph"]])
def test_components_must_name_model_or_loss(components):
    with pytest.raises(ValueError, match="compile.components must name model and/or loss"):
        Compile(components=components)


@pytest.mark.slow
def test_compiled_loss_trains_like_eager(tmp_path):
    """~30 s on 2 loaded cores: inductor compiles the loss forward and backward on the CPU."""
    args = [*TINY, "--training.steps", "3"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "eager")])
    proc = run_train([*args, "--compile.enable", "--compile.components", "loss",
                      "--job.dump_folder", str(tmp_path / "compiled")])
    assert "compiled the loss" in proc.stderr + proc.stdout
    eager = losses(tmp_path / "eager")
    assert len(eager) == 3 and losses(tmp_path / "compiled") == pytest.approx(eager, rel=1e-5)
