"""morphens.native: BatchNorm + ReLU (+ 2x2 max pooling) in C equals torch's ops in float64, pooling's choices
included."""

import pytest
import torch
import torch.nn.functional as F

from morphens import native
from morphens.arch import VGG, Conv
from morphens.models import Net, to_channels_last, update_running_stats

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


def _apply(z: torch.Tensor, bn: torch.nn.BatchNorm2d, pool: bool) -> torch.Tensor:
    """What a served ConvBN does after its convolution."""
    y, mean, var = native.bn_relu_pool(z, bn, pool)
    update_running_stats(bn, z, mean, var)
    return y


def _bn(c: int) -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(c).train()
    with torch.no_grad():
        bn.weight.uniform_(-1, 2)  # negative scales flip which input wins a window
        bn.bias.uniform_(-1, 1)
    return bn


@pytest.mark.parametrize("shape", [(8, 6, 28, 28), (4, 13, 14, 14), (3, 5, 7, 7), (2, 3, 5, 6), (2, 1, 4, 4)])
@pytest.mark.parametrize("pool", [False, True])
def test_matches_torch_in_float64(shape, pool):
    torch.manual_seed(0)
    z = to_channels_last(torch.randn(shape) * 2 + 0.5).requires_grad_()
    bn = _bn(shape[1])
    bn64 = torch.nn.BatchNorm2d(shape[1]).double().train()
    bn64.load_state_dict(bn.state_dict())
    assert native.served(z, bn)
    y = _apply(z, bn, pool)
    z64 = z.detach().double().requires_grad_()
    y64 = F.relu(bn64(z64))
    y64 = F.max_pool2d(y64, 2) if pool else y64
    g = torch.randn_like(y64)
    got = torch.autograd.grad(y, (z, bn.weight, bn.bias), g.float())
    want = torch.autograd.grad(y64, (z64, bn64.weight, bn64.bias), g)
    for t in (y, got[0]):
        assert t.is_contiguous(memory_format=torch.channels_last)
    for a, b in [(y, y64), *zip(got, want), (bn.running_mean, bn64.running_mean), (bn.running_var, bn64.running_var)]:
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)  # float32 rounding of O(1) values


def test_pooling_keeps_the_first_maximum_of_each_window():
    # Ties everywhere: after BatchNorm equal inputs give equal outputs, so only the scan order picks the winner.
    z = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 3.0, 3.0], [2.0, 2.0, 3.0, 3.0]])
    z = z.view(1, 1, 4, 4).repeat(2, 3, 1, 1).contiguous(memory_format=torch.channels_last).requires_grad_()
    bn = torch.nn.BatchNorm2d(3).train()
    g = torch.arange(24.0).view(2, 3, 2, 2)
    got = torch.autograd.grad(_apply(z, bn, True), z, g)[0]
    z2 = z.detach().clone().requires_grad_()
    want = torch.autograd.grad(F.max_pool2d(F.relu(torch.nn.BatchNorm2d(3).train()(z2)), 2), z2, g)[0]
    torch.testing.assert_close(got, want)  # the last maximum winning moves a window's gradient to another input


def test_nets_train_the_same_with_and_without_it(monkeypatch):
    arch = VGG((1, 12, 12), 10, ((Conv(4, 3), Conv(5, 3)), (Conv(6, 5),), (Conv(7, 3),)))
    x, y = torch.randn(16, 1, 12, 12), torch.randint(0, 10, (16,))
    grads = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MORPHENS_NATIVE", flag)
        torch.manual_seed(0)
        net = Net(arch).train()
        F.cross_entropy(net(x), y).backward()
        grads.append([p.grad for p in net.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_switch_and_what_it_does_not_serve(monkeypatch):
    z = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    bn = torch.nn.BatchNorm2d(3).train()
    assert native.served(z, bn)
    assert not native.served(z.contiguous(), bn)  # channels-first
    assert not native.served(z.double(), bn.double())
    assert not native.served(z, bn.eval())
    monkeypatch.setenv("MORPHENS_NATIVE", "0")
    assert not native.served(z, bn.train())
