"""The nets built from a spec: parameter counts by hand, a head that is a linear map over the flattened features,
a fresh initialization after `to_empty`, and parameter names that depend only on the spec."""

import pytest
import torch
import torch.nn.functional as F

from morphens.arch import MLP, VGG, Conv, ResNet, Stage
from morphens.models import Net, build, num_params

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
    features = net.layers["1"](F.max_pool2d(net.layers["0"](x), 2))
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
