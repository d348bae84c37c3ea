"""A ModelSpec that names only the required parts scores with cross-entropy and has no optional hooks."""

from titan.components.loss import cross_entropy_loss
from titan.protocols.model_spec import ModelSpec


def test_a_minimal_spec_defaults_to_cross_entropy_and_no_hooks():
    spec = ModelSpec("m", {}, build_model=None, parallelize=None, build_dataloader=None)
    assert spec.loss_fn is cross_entropy_loss
    hooks = ("build_tokenizer", "update_model_args", "flops_per_token", "args_from_folder", "load_hf_weights",
             "metrics_fn")
    assert [getattr(spec, h) for h in hooks] == [None] * len(hooks)
