"""The nets built from a spec: parameter counts by hand, a head that is a linear map over the flattened features,
a fresh initialization after `to_empty`, parameter names that depend only on the spec, and a BatchNorm + ReLU
that gives torch's results (float64) with torch's running statistics."""

import pytest
import torch
import torch.nn.functional as F

from morphens import models
from morphens.arch import MLP, VGG, Conv, ResNet, Stage
from morphens.models import Net, bn_relu, build, num_params, to_channels_last

MLP_ARCH = MLP((1, 8, 8), 10, (16,))
VGG_ARCH = VGG((3, 8, 8), 10, ((Conv(4, 3),), (Conv(8, 5),)))


def test_parameter_counts_by_hand():
    # fc 64 x 16 without bias, BatchNorm 2 x 16, head 16 x 10 + 10.
    assert num_params(MLP_ARCH) == 64 * 16 + 2 * 16 + 16 * 10 + 10
    # conv 3 -> 4 (3 x 3), BN; conv 4 -> 8 (5 x 5), BN; after one 2 x 2 pool a 4 x 4 map: head 8 x 16 -> 10.
    assert num_params(VGG_ARCH) == 3 * 4 * 9 + 8 + 4 * 8 * 25 + 16 + 8 * 16 * 10 + 10


def test_the_vgg_head_is_a_linear_map_of_the_flattened_last_feature_map():
    net = build(VGG_ARCH).eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    features = net.layers["1"](net.layers["0"](x))  # a VGG block pools in its last layer
    by_hand = F.linear(features.flatten(1), net.head.weight.flatten(1), net.head.bias)
    torch.testing.assert_close(net(x), by_hand)


@pytest.mark.parametrize("arch", [MLP_ARCH, VGG_ARCH, ResNet((3, 8, 8), 10, (Stage(4, (2,)), Stage(8, (4,))))],
                         ids=["mlp", "vgg", "resnet"])
def test_to_empty_then_init_weights_gives_fresh_batchnorm_and_a_zero_bias_head(arch):
    with torch.device("meta"):
        net = Net(arch)
    net.to_empty(device="cpu")
    net.init_weights()
    bns = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bns and all(torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
                       and torch.equal(m.running_var, torch.ones_like(m.running_var)) for m in bns)
    assert torch.equal(net.head.bias, torch.zeros(10))
    assert net(torch.randn(4, *arch.in_shape)).shape == (4, 10)


def test_head_weights_have_std_one_over_root_fan_in():
    net = build(MLP((1, 32, 32), 100, (1024,)))
    assert net.head.weight.std().item() == pytest.approx(1024 ** -0.5, rel=0.03)


def test_parameter_names_depend_only_on_the_spec():
    names = [n for n, _ in build(VGG_ARCH).named_parameters()]
    assert names == [n for n, _ in build(VGG_ARCH).named_parameters()]
    assert names[:3] == ["layers.0.0.conv.weight", "layers.0.0.bn.weight", "layers.0.0.bn.bias"]


@pytest.mark.parametrize("shape", [(3, 1, 5, 7), (8, 6, 4, 4), (4, 13, 6, 6), (2, 24, 3, 3)],
                         ids=["one-channel-odd-pixels", "6ch-64-pixel-rows", "13ch", "24ch"])
def test_bn_relu_in_training_gives_torchs_outputs_gradients_and_running_statistics(shape):
    gen = torch.Generator().manual_seed(0)
    x = to_channels_last(torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1)
    grad_y = to_channels_last(torch.randn(shape, generator=gen, dtype=torch.float64))
    ours, ref = (torch.nn.BatchNorm2d(shape[1]).double() for _ in range(2))
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=gen)
        ours.bias.uniform_(-0.5, 0.5, generator=gen)
    ref.load_state_dict(ours.state_dict())
    results = []
    for bn, f in ((ours, bn_relu), (ref, lambda x, bn: F.relu(bn(x)))):
        xi = x.clone().requires_grad_()
        for _ in range(2):  # the running statistics move twice
            y = f(xi, bn)
        y.backward(grad_y)
        results.append([y, xi.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert models.channels_last(results[0][0]) and models.channels_last(results[0][1])
    assert ours.num_batches_tracked == ref.num_batches_tracked == 2


def test_a_training_step_with_bn_relu_gives_the_gradients_of_torchs_batch_norm_in_float64(monkeypatch):
    arch = ResNet((3, 8, 8), 10, (Stage(4, (2,)), Stage(6, (5,))))
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 10
    ours = build(arch).train()
    F.cross_entropy(ours(x), y).backward()
    monkeypatch.setattr(models, "bn_relu", lambda x, bn: F.relu(bn(x)))
    ref = Net(arch).double().train()
    ref.load_state_dict(ours.state_dict())
    F.cross_entropy(ref(x.double()), y).backward()
    for (name, p), r in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad.float(), rtol=1e-4, atol=1e-6, msg=name)
