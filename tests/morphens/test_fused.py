"""The C BatchNorm + ReLU, 2x2 max pooling (which has no training mode) and one-channel convolution against
torch's ops: the pooling equal bit for bit (values and gradients, with ties, NaN and odd sizes), the others to
float rounding (outputs, gradients, BatchNorm's running statistics); where the kernels do not apply the torch ops
run, and a missing compiler only costs speed."""

import copy
import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import needs_compiler
from torch import nn

from morphens import fused
from morphens.arch import VGG, Conv
from morphens.models import build, to_channels_last


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """A cache folder of its own and no library loaded yet."""
    monkeypatch.setenv("MORPHENS_CACHE_DIR", str(tmp_path))
    fused.library.cache_clear()
    yield tmp_path
    fused.library.cache_clear()


def grads(x, *tensors, seed=1):
    """The input's and the tensors' gradients of a random linear function of x."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(x, tensors, dy)


def laid_out(x, layout):
    """x in channels-first or channels-last memory (strides that say so, also for one channel)."""
    return x.contiguous() if layout == "nchw" else to_channels_last(x)


@needs_compiler
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("shape, offset", [((16, 6, 28, 28), 0.0), ((5, 3, 7, 9), 50.0), ((2, 4, 1, 1), 0.0),
                                           ((3, 35, 5, 5), 0.0), ((3, 2, 683, 1), 0.0)],
                         ids=["mother_layer", "odd_far_from_zero", "one_pixel", "member_width", "two_flushes_and_2"])
def test_bn_relu_equals_batchnorm_then_relu_in_training_mode(shape, offset, layout):
    gen = torch.Generator().manual_seed(0)
    x = laid_out(torch.randn(shape, generator=gen) * 3 + offset, layout).requires_grad_()
    ours, theirs = nn.BatchNorm2d(shape[1]), nn.BatchNorm2d(shape[1])
    with torch.no_grad():
        for bn in (ours, theirs):
            bn.weight.copy_(torch.linspace(0.5, 2, shape[1]))
            bn.bias.copy_(torch.linspace(-1, 1, shape[1]))
    y_ours, y_theirs = fused.bn_relu(x, ours), F.relu(theirs(x))
    assert type(y_ours.grad_fn).__name__ == "_BatchNormReLUBackward" and y_ours.stride() == x.stride()
    torch.testing.assert_close(y_ours, y_theirs, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads(y_ours, x, ours.weight, ours.bias), grads(y_theirs, x, theirs.weight, theirs.bias)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for name, buffer in theirs.named_buffers():
        torch.testing.assert_close(getattr(ours, name), buffer, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_bn_relu_is_as_exact_as_torch_far_from_zero(layout):
    """Inputs around 1000 +- 3: a float32 sum of squares would lose the variance; the shifted sums do not."""
    x = laid_out(torch.randn(5, 3, 7, 9, generator=torch.Generator().manual_seed(0)) * 3 + 1000, layout)
    exact = F.relu(nn.BatchNorm2d(3).double()(x.double()))
    ours, theirs = fused.bn_relu(x, nn.BatchNorm2d(3)), F.relu(nn.BatchNorm2d(3)(x))
    assert (ours.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()


@needs_compiler
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_max_pool2_equals_torch_bit_for_bit_with_ties_nan_and_odd_sizes(layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (3, 4, 9, 7), generator=gen).float()  # many ties, zeros among them, as after a ReLU
    x[0, 0, :2, :2] = float("nan")
    x[0, 1, 0, 1] = float("nan")
    x[1, 0, :2, :2] = float("-inf")
    x = laid_out(x, layout).requires_grad_()
    ours, theirs = fused.max_pool2(x), F.max_pool2d(x, 2)
    assert type(ours.grad_fn).__name__ == "_MaxPool2Backward" and fused.channels_last(ours) == (layout == "nhwc")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(grads(ours, x)[0], grads(theirs, x)[0])


@needs_compiler
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("kernel, size", [(3, (28, 28)), (5, (7, 9)), (1, (4, 4)), (7, (3, 5))])
def test_one_channel_conv_equals_torch_to_rounding(kernel, size, layout):
    """The output takes the input's layout, which one channel only shows in its strides."""
    gen = torch.Generator().manual_seed(0)
    layer = nn.Conv2d(1, 6, kernel, padding=kernel // 2, bias=False)
    x = laid_out(torch.randn(5, 1, *size, generator=gen), layout).requires_grad_()
    ours, theirs = fused.conv(x, layer), layer(x)
    assert type(ours.grad_fn).__name__ == "_Conv1Backward" and fused.channels_last(ours) == (layout == "nhwc")
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads(ours, x, layer.weight), grads(theirs, x, layer.weight)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer", [nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.Conv2d(1, 4, 3, padding=1),
                                   nn.Conv2d(1, 4, 3, padding=1, stride=2, bias=False),
                                   nn.Conv2d(1, 4, 2, padding=1, bias=False), nn.Conv2d(1, 4, 3, bias=False)],
                         ids=["two_channels", "bias", "stride", "even_kernel", "no_padding"])
def test_other_convolutions_run_as_torch_ops(layer):
    x = torch.randn(2, layer.in_channels, 6, 6)
    y = fused.conv(x, layer)
    assert type(y.grad_fn).__name__ == "ConvolutionBackward0"
    torch.testing.assert_close(y, layer(x))


@pytest.mark.parametrize("case", ["float64", "two_threads", "strided", "eval_mode", "compiled"])
def test_where_the_kernels_do_not_apply_the_torch_ops_run(case):
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64 if case == "float64" else torch.float32)
    bn = nn.BatchNorm2d(3).to(x.dtype).train(case != "eval_mode")
    if case == "strided":
        x = x.transpose(2, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if case == "two_threads" else 1)
    try:
        if case == "compiled":
            y = torch.compile(lambda t: fused.max_pool2(fused.bn_relu(t, bn)), backend="eager")(x.requires_grad_())
            assert "_MaxPool2" not in type(y.grad_fn).__name__
        else:
            y = fused.bn_relu(x.requires_grad_(), bn)
            assert type(y.grad_fn).__name__ == "ReluBackward0"
            pooled = type(fused.max_pool2(x).grad_fn).__name__
            c_pool = case == "eval_mode" and fused.library() is not None  # pooling has no mode: C where built
            assert pooled == ("_MaxPool2Backward" if c_pool else "MaxPool2DWithIndicesBackward0")
    finally:
        torch.set_num_threads(threads)


def test_a_net_trains_the_same_with_the_kernels_as_with_the_torch_ops(monkeypatch):
    """One training step of a VGG net: its loss, gradients and BatchNorm statistics."""
    net = build(VGG((1, 12, 12), 10, ((Conv(4, 3), Conv(5, 5)), (Conv(6, 3),)))).train()
    twin = copy.deepcopy(net)
    x, y = torch.randn(8, 1, 12, 12), torch.arange(8)
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    monkeypatch.setattr(fused, "_served", lambda *tensors: False)
    twin_loss = F.cross_entropy(twin(x), y)
    twin_loss.backward()
    torch.testing.assert_close(loss, twin_loss, atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    for a, b in zip(net.buffers(), twin.buffers()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cc", [None, "/bin/false"], ids=["no_compiler", "failing_compiler"])
def test_without_a_working_compiler_the_torch_ops_run_with_a_warning(fresh_library, monkeypatch, caplog,
                                                                      cc):
    monkeypatch.setattr(fused, "compiler", lambda: cc)
    with caplog.at_level(logging.WARNING, logger="morphens.fused"):
        y = fused.max_pool2(torch.randn(2, 3, 4, 4, requires_grad=True))
    assert type(y.grad_fn).__name__ == "MaxPool2DWithIndicesBackward0"
    assert "BatchNorm + ReLU and max pooling run as torch ops (slower)" in caplog.text
    assert not list(fresh_library.glob("native/*"))


@needs_compiler
def test_a_damaged_library_is_reported_and_left_for_the_user_to_delete(fresh_library, caplog):
    damaged = fused.library_path(fused.compiler())
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger="morphens.fused"):
        assert fused.library() is None
    assert f"loading {damaged} failed" in caplog.text and "delete it to rebuild" in caplog.text


@needs_compiler
def test_source_compiles_without_warnings(tmp_path):
    command = fused.build_command(fused.compiler(), tmp_path / "k.so")
    proc = subprocess.run([command[0], "-Wall", "-Wextra", "-Werror", *command[1:]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
