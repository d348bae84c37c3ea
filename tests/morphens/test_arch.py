import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from morphens.arch import (
    MLP,
    VGG,
    Conv,
    Generator,
    ResNet,
    Stage,
    arch_from_dict,
    arch_to_dict,
    describe,
    forward_flops,
)
from morphens.models import build

SHAPE = (3, 16, 16)


@pytest.mark.parametrize("family", ["vgg", "resnet", "mlp"])
def test_generated_members_build_run_and_round_trip(family):
    members = Generator(family, blocks=3, width=4, max_depth=3).sample(5, SHAPE, 7, seed=1)
    assert len({describe(m) for m in members}) > 1  # diverse
    for arch in members:
        assert build(arch)(torch.randn(2, *SHAPE)).shape == (2, 7)
        assert arch_from_dict(arch_to_dict(arch), SHAPE, 7) == arch


@pytest.mark.parametrize("family", ["vgg", "resnet", "mlp"])
def test_forward_flops_match_torch_flop_counter(family):
    arch = Generator(family, blocks=3, width=4, max_depth=2).sample(1, SHAPE, 7, seed=2)[0]
    net = build(arch).eval()
    with FlopCounterMode(display=False) as counter:
        net(torch.randn(1, *SHAPE))
    assert forward_flops(arch) == counter.get_total_flops()


def test_parse_layer_notations():
    arch = arch_from_dict({"family": "vgg", "blocks": [[16, [16, 5]], [{"width": 32, "kernel": 7}]]}, SHAPE, 10)
    assert arch == VGG(SHAPE, 10, ((Conv(16), Conv(16, 5)), (Conv(32, 7),)))
    assert describe(arch) == "vgg[16k3,16k5|32k7]"
    res = arch_from_dict({"family": "resnet", "stages": [{"width": 8, "blocks": [8, 4]}, {"width": 16}]}, SHAPE, 10)
    assert res == ResNet(SHAPE, 10, (Stage(8, (8, 4)), Stage(16, ())))
    assert describe(res) == "resnet[8:8,4|16:]"
    assert arch_from_dict({"family": "mlp", "hidden": [64], "in_shape": [3, 16, 16]}, SHAPE, 10) == MLP(SHAPE, 10,
                                                                                                         (64,))


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"family": "transformer", "layers": 3}, "unknown family 'transformer'"),
        ({"family": "vgg", "blocks": [["conv3x3"]]}, "unknown layer type"),
        ({"family": "resnet", "stages": [[8, 8]]}, "unknown layer type"),
        ({"family": "vgg", "blocks": [[[16, 4]]]}, "kernel must be a positive odd integer"),
        ({"family": "vgg", "blocks": [[0]]}, "width must be a positive integer"),
        ({"family": "vgg", "blocks": [[8], []]}, "at least one layer per block"),
        ({"family": "vgg", "blocks": [[8]] * 6}, "below 1x1"),
        ({"family": "mlp", "hidden": []}, "at least one hidden layer"),
        ({"family": "mlp", "hidden": [8], "depth": 2}, "needs exactly the key 'hidden'"),
        ({"family": "mlp", "hidden": [8], "num_classes": 100}, "num_classes 100 does not match the data's 10"),
        ({"family": "mlp", "hidden": [8], "in_shape": [1, 28, 28]}, "in_shape .* does not match"),
    ],
)
def test_bad_specs_are_refused_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message):
        arch_from_dict(spec, SHAPE, 10)


def test_generator_validation():
    with pytest.raises(ValueError, match="family .densenet. is unknown; choose vgg, resnet, mlp or mixed"):
        Generator("densenet")
    with pytest.raises(ValueError, match="kernel must be"):
        Generator(kernels=(3, 4))
