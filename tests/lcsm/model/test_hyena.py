import pytest
import torch

from lcsm.model.hyena import HyenaLM, flops_per_token, num_params
from tests.lcsm.conftest import TINY_ARGS as ARGS
from tests.lcsm.conftest import tiny_hyena


@pytest.fixture(scope="module")
def model():
    return tiny_hyena()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(1))


def test_filter_depends_on_position_only(model):
    f = model.layers["0"].mixer.filter
    torch.testing.assert_close(f(10), f(24)[:, :10], rtol=0, atol=1e-15)
    assert model.inference_filters().shape == (ARGS.n_layers * ARGS.order, ARGS.dim, ARGS.max_seq_len)


def test_training_forward_backward_gives_every_parameter_a_gradient(model, tokens):
    m = HyenaLM(ARGS)
    m.init_weights()
    loss = torch.nn.functional.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_too_long_sequence_names_the_fix(model):
    with pytest.raises(ValueError, match="larger max_seq_len"):
        model(torch.zeros(1, ARGS.max_seq_len + 1, dtype=torch.long))


def test_init_on_meta_then_to_empty(tokens):
    with torch.device("meta"):
        m = HyenaLM(ARGS)
    m.to_empty(device="cpu")
    m.init_weights()
    assert torch.isfinite(m(tokens)).all()


def test_flops_per_token_exceeds_six_times_parameters(model):
    assert flops_per_token(model, ARGS, 24) > 6 * num_params(model, exclude_embedding=True)
