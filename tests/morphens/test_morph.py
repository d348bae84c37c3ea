import copy

import pytest
import torch

from morphens.arch import MLP, VGG, Conv, Generator, ResNet, Stage
from morphens.models import Net, build
from morphens.morph import add_noise, check_reachable, deepen, grow_kernel, hatch, units, widen
from morphens.mother import mother_of

SHAPE = (2, 12, 12)
NETS = {
    "vgg": VGG(SHAPE, 5, ((Conv(4), Conv(6, 5)), (Conv(8),))),
    "resnet": ResNet(SHAPE, 5, (Stage(4, (3,)), Stage(6, (5, 2)))),
    "mlp": MLP(SHAPE, 5, (16, 8)),
}


def trained_looking(arch, seed=0) -> Net:
    """A net whose BatchNorm layers have non-trivial statistics and affine parameters, in eval mode."""
    torch.manual_seed(seed)
    net = build(arch)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        net.head.weight.mul_(0.3)  # logits of order 1, where float32 rounding stays far below 1e-5
    return net.eval()


def snapshot(net):
    return {k: v.clone() for k, v in net.state_dict().items()}


def assert_same_function(parent, child, x, train=False):
    """Compares outputs; train mode runs on copies, since it updates BatchNorm statistics."""
    parent, child = (copy.deepcopy(parent), copy.deepcopy(child)) if train else (parent.eval(), child.eval())
    parent.train(train)
    child.train(train)
    torch.testing.assert_close(child(x), parent(x), atol=1e-5, rtol=0)


X = torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", NETS)
def test_widen_every_unit_is_exact_in_eval_and_train_mode(family):
    parent = trained_looking(NETS[family])
    before = snapshot(parent)
    for key, unit in units(parent.arch).items():
        child = widen(parent, key, unit.width + 3, torch.Generator().manual_seed(0))
        assert units(child.arch)[key].width == unit.width + 3
        assert_same_function(parent, child, X)
        assert_same_function(parent, child, X, train=True)  # replicas share the batch statistics
    assert all(torch.equal(before[k], v) for k, v in parent.state_dict().items())


def test_widen_splits_outgoing_weights_by_replica_count():
    parent = trained_looking(NETS["mlp"])
    child = widen(parent, ("hidden", 1), 24, torch.Generator().manual_seed(0))
    old, new = parent.head.weight, child.head.weight
    torch.testing.assert_close(new.sum(1), old.sum(1))  # the replicas of a column sum back to it
    assert torch.equal(child.layers["1"].bn.running_var[:8], parent.layers["1"].bn.running_var)


@pytest.mark.parametrize("family", NETS)
def test_deepen_every_block_is_exact_in_eval_mode(family):
    parent = trained_looking(NETS[family])
    before = snapshot(parent)
    blocks = {"vgg": 2, "resnet": 2, "mlp": 1}[family]
    for block in range(blocks):
        child = deepen(parent, block, kernel=5, inner=7, gen=torch.Generator().manual_seed(0))
        assert sum(p.numel() for p in child.parameters()) > sum(p.numel() for p in parent.parameters())
        assert_same_function(parent, child, X)
    assert all(torch.equal(before[k], v) for k, v in parent.state_dict().items())


def test_new_residual_block_is_exact_in_train_mode_too():
    parent = trained_looking(NETS["resnet"])
    child = deepen(parent, 1, inner=9)
    assert_same_function(parent, child, X, train=True)


def test_calibrated_identity_layer_is_the_identity_in_train_mode_on_its_batch():
    parent = trained_looking(NETS["vgg"])
    plain, calibrated = deepen(parent, 0), deepen(parent, 0, calib=X)
    assert_same_function(parent, calibrated, X)
    assert_same_function(parent, calibrated, X, train=True)
    parent, plain = (copy.deepcopy(n).train() for n in (parent, plain))
    assert (plain(X) - parent(X)).abs().max() > 1e-2  # uncalibrated, it standardizes its input in train mode


@pytest.mark.parametrize("family", ["vgg", "mlp"])
def test_uncalibrated_identity_layers_are_exact_in_float64(family):
    """Three identity layers in a float64 net: BatchNorm's sqrt(1 + eps) must be rounded in float64 too (built in
    float32, each layer was off by ~1e-8, far above float64 rounding)."""
    parent = trained_looking(NETS[family]).double()
    child = parent
    for _ in range(3):
        child = deepen(child, 0)
    x = X.double()
    assert child.head.weight.dtype == torch.float64
    torch.testing.assert_close(child.eval()(x), parent(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("calib", [None, X])
def test_deepen_refuses_a_block_out_of_range(calib):
    with pytest.raises(ValueError, match=r"deepen: block 5 out of range for vgg\[.*\] \(2 blocks\)"):
        deepen(trained_looking(NETS["vgg"]), 5, calib=calib)


def test_grow_kernel_is_exact_in_eval_and_train_mode():
    parent = trained_looking(NETS["vgg"])
    for block, layer, kernel in ((0, 0, 5), (0, 1, 7), (1, 0, 7)):
        child = grow_kernel(parent, block, layer, kernel)
        assert child.layers[str(block)][layer].conv.kernel_size == (kernel, kernel)
        assert_same_function(parent, child, X)
        assert_same_function(parent, child, X, train=True)


@pytest.mark.parametrize("amount", [0.01, 0.1])
@torch.no_grad()
def test_noise_moves_logits_by_the_asked_amount(amount):
    parent = trained_looking(NETS["vgg"])
    before = snapshot(parent)
    child = add_noise(parent, amount, X, torch.Generator().manual_seed(0)).eval()
    ref = parent(X)
    moved = float((child(X) - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert abs(moved / amount - 1) < 0.02
    assert all(torch.equal(before[k], v) for k, v in parent.state_dict().items())


@torch.no_grad()
def test_noise_on_one_element_and_replicated_weights_stays_finite_and_breaks_symmetry():
    """A 1x1x1x1 conv has no std (one element) and its three replicas after widening have std 0: the noise still
    moves the logits by the asked amount, and the replicas come apart."""
    x = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    mother = trained_looking(VGG((1, 4, 4), 2, ((Conv(1, 1),),)))
    for net in (mother, widen(mother, ("conv", 0, 0), 3)):
        child = add_noise(net, 0.01, x, torch.Generator().manual_seed(0)).eval()
        weight = child.state_dict()["layers.0.0.conv.weight"]
        assert torch.isfinite(weight).all()
        moved = float((child(x) - net(x)).pow(2).mean().sqrt() / net(x).pow(2).mean().sqrt())
        assert abs(moved / 0.01 - 1) < 0.02
    assert weight.flatten().unique().numel() == 3


@pytest.mark.parametrize("family", ["vgg", "resnet", "mlp"])
@pytest.mark.parametrize("seed", range(6))
def test_random_hatches_compute_the_mother_function(family, seed):
    members = Generator(family, blocks=2, width=3, max_depth=3).sample(4, SHAPE, 5, seed)
    mother = trained_looking(mother_of(members), seed)
    before = snapshot(mother)
    x = torch.randn(8, *SHAPE, generator=torch.Generator().manual_seed(seed))
    for i, member in enumerate(members):
        child = hatch(mother, member, seed=i, calib=x)
        assert child.arch == member
        assert_same_function(mother, child, x)
        assert_same_function(mother, child, x, train=True)  # identity layers calibrated on x are exact on x
    assert all(torch.equal(before[k], v) for k, v in mother.state_dict().items())
    # In float64 the only difference left is rounding: the morphisms are exact.
    mother64, x64 = mother.double(), x.double()
    child64 = hatch(mother64, members[0], seed=0, calib=x64).eval()
    torch.testing.assert_close(child64(x64), mother64(x64), atol=1e-12, rtol=0)


@torch.no_grad()
def test_hatch_with_noise_is_close_but_not_equal():
    members = Generator("vgg", blocks=2, width=3).sample(3, SHAPE, 5, 0)
    mother = trained_looking(mother_of(members))
    child = hatch(mother, members[0], noise=0.02, calib=X).eval()
    moved = float((child(X) - mother(X)).pow(2).mean().sqrt() / mother(X).pow(2).mean().sqrt())
    assert 0.019 < moved < 0.021


def test_hatching_the_mother_itself_returns_an_equal_copy():
    mother = trained_looking(NETS["resnet"])
    child = hatch(mother, mother.arch)
    assert child is not mother
    assert_same_function(mother, child, X)


@pytest.mark.parametrize(
    "member, message",
    [
        (VGG(SHAPE, 5, ((Conv(3), Conv(6, 5)), (Conv(8),))), "smaller than the mother"),
        (VGG(SHAPE, 5, ((Conv(4), Conv(6, 3)), (Conv(8),))), "kernel >= 5"),
        (VGG(SHAPE, 5, ((Conv(4),), (Conv(8),))), "fewer layers"),
        (VGG(SHAPE, 5, ((Conv(4), Conv(6, 5), Conv(5)), (Conv(8),))), "needs width >= 6"),
        (VGG(SHAPE, 5, ((Conv(4), Conv(6, 5)),)), "different numbers of blocks"),
        (VGG((2, 12, 12), 7, ((Conv(4), Conv(6, 5)), (Conv(8),))), "input/output shapes differ"),
        (MLP(SHAPE, 5, (16, 8)), "different families"),
    ],
)
def test_unreachable_members_are_refused_with_the_reason(member, message):
    with pytest.raises(ValueError, match=message):
        check_reachable(NETS["vgg"], member)
    with pytest.raises(ValueError, match="cannot hatch"):
        hatch(build(NETS["vgg"]), member)


@pytest.mark.parametrize(
    "member, message",
    [
        (MLP(SHAPE, 5, (16,)), "fewer hidden layers than the mother's$"),
        (MLP(SHAPE, 5, (16, 6)), r"hidden layer 1 is narrower than the mother's \(needs width >= 8\)$"),
        (MLP(SHAPE, 5, (16, 8, 7)), r"hidden layer 2 is narrower than the mother's \(needs width >= 8\)$"),
    ],
)
def test_unreachable_mlps_are_refused_in_terms_of_hidden_layers(member, message):
    """MLPs have hidden layers, not blocks or kernels: the reason says so."""
    with pytest.raises(ValueError, match=message):
        check_reachable(NETS["mlp"], member)


def test_morphisms_refuse_to_shrink():
    net = build(NETS["vgg"])
    with pytest.raises(ValueError, match="cannot narrow"):
        widen(net, ("conv", 0, 0), 2)
    with pytest.raises(ValueError, match="larger odd size"):
        grow_kernel(net, 0, 1, 3)
    with pytest.raises(ValueError, match="no unit"):
        widen(net, ("hidden", 0), 9)
    with pytest.raises(ValueError, match="calibration batch"):
        hatch(net, NETS["vgg"], noise=0.1)
