"""Plain single-device modules built from an architecture spec.

Stages (VGG blocks, ResNet stages, MLP hidden layers) live in `model.layers`, an nn.ModuleDict, so titan's FSDP
wraps them one by one. Parameter names are a pure function of the spec, which is what morphisms rely on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from morphens import native
from morphens.arch import MLP, VGG, Arch, ResNet, final_size

BN_EPS = 1e-5
"""Every BatchNorm's eps (the identity layers that morphisms insert are built with it)."""


def channels_last(x: torch.Tensor) -> bool:
    """Whether a (N, C, H, W) tensor lies channels-last in memory, read from the strides as oneDNN does (so that one
    channel can be either)."""
    return x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """x in channels-last memory with strides that say so, also for one channel (where `contiguous(memory_format)`
    keeps channels-first strides): each layer keeps its input's layout, and at these widths oneDNN's convolutions
    run faster channels-last (benchmarks/RESULTS.md)."""
    if channels_last(x):
        return x
    return x.new_empty(x.shape[0], *x.shape[2:], x.shape[1]).permute(0, 3, 1, 2).copy_(x)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A channels-last (N, C, H, W) tensor's memory as (rows, k * C): k whole pixels a row (k | N * H * W, up to 64),
    so that per-channel vectors tiled k times broadcast over long contiguous rows."""
    n, c, h, w = x.shape
    k = math.gcd(n * h * w, 64)
    return x.permute(0, 2, 3, 1).reshape(n * h * w // k, k * c), k


def _channel_sum(x2: torch.Tensor, k: int) -> torch.Tensor:
    return x2.sum(0).view(k, -1).sum(0)


def _unrows(x2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n, c, h, w = shape
    return x2.view(n, h, w, c).permute(0, 3, 1, 2)


class _BatchNormReLU(torch.autograd.Function):
    """relu(batch_norm(x)) in training mode over a channels-last CPU tensor, with the batch's statistics; returns
    (y, mean, biased var). Every op runs over (rows, k * C) rows: torch's own batch norm and its broadcasts loop over
    C values at a time there, which for a mother's 6-24 channels costs ~10x a memory pass (benchmarks/RESULTS.md)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2, k = _rows(x)
        count = x2.shape[0] * k
        mean = _channel_sum(x2, k) / count
        var = _channel_sum((x2 - mean.repeat(k)).square_(), k) / count
        rstd = (var + eps).rsqrt()
        scale = weight * rstd
        y2 = torch.addcmul((bias - mean * scale).repeat(k), x2, scale.repeat(k)).relu_()
        ctx.save_for_backward(x2, y2, weight, mean, rstd)
        ctx.k, ctx.shape = k, x.shape
        ctx.mark_non_differentiable(mean, var)
        return _unrows(y2, x.shape), mean, var

    @staticmethod
    def backward(ctx, grad_y, _mean, _var):
        x2, y2, weight, mean, rstd = ctx.saved_tensors
        k, count = ctx.k, x2.shape[0] * ctx.k
        grad_z = torch.ops.aten.threshold_backward(grad_y.permute(0, 2, 3, 1).reshape(x2.shape), y2, 0)
        grad_bias = _channel_sum(grad_z, k)
        grad_weight = (_channel_sum(grad_z * x2, k) - mean * grad_bias) * rstd
        # dx = a * dz + b * x + c per channel: the batch-norm backward with the statistics' gradients folded in.
        a = weight * rstd
        b = -a * rstd * grad_weight / count
        c = -a * grad_bias / count - b * mean
        grad_x2 = torch.addcmul(c.repeat(k), x2, b.repeat(k)).addcmul_(grad_z, a.repeat(k))
        return _unrows(grad_x2, ctx.shape), grad_weight, grad_bias, None


def bn_relu(x: torch.Tensor, bn: nn.BatchNorm2d) -> torch.Tensor:
    """relu(bn(x)); in training on a channels-last CPU tensor through _BatchNormReLU (same result to float
    rounding, running statistics updated as torch does), else torch's ops."""
    if not (bn.training and x.device.type == "cpu" and channels_last(x) and bn.affine and bn.track_running_stats
            and bn.momentum is not None):
        return F.relu(bn(x))
    y, mean, var = _BatchNormReLU.apply(x, bn.weight, bn.bias, bn.eps)
    update_running_stats(bn, x, mean, var)
    return y


@torch.no_grad()
def update_running_stats(bn: nn.BatchNorm2d, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> None:
    """bn's running statistics after a training batch x of this mean and biased variance, as torch's BatchNorm
    updates them (the running variance is the unbiased one)."""
    count = x.numel() // x.shape[1]
    bn.running_mean.lerp_(mean, bn.momentum)
    bn.running_var.lerp_(var * count / max(count - 1, 1), bn.momentum)
    bn.num_batches_tracked.add_(1)


class ConvBN(nn.Module):
    """conv -> BatchNorm -> ReLU, then `pool` (2x2 max pooling in the last layer of a VGG block that has one after it,
    else the identity); in one pass of morphens.native in training steps where it serves."""

    def __init__(self, c_in: int, c_out: int, kernel: int, pool: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=BN_EPS)
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.conv(x)
        if native.served(z, self.bn):
            y, mean, var = native.bn_relu_pool(z, self.bn, isinstance(self.pool, nn.MaxPool2d))
            update_running_stats(self.bn, z, mean, var)
            return y
        return self.pool(bn_relu(z, self.bn))


class LinearBN(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.fc = nn.Linear(c_in, c_out, bias=False)
        self.bn = nn.BatchNorm1d(c_out, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.fc(x)))


class ResBlock(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, inner, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(inner, eps=BN_EPS)
        self.conv2 = nn.Conv2d(inner, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(bn_relu(self.conv1(x), self.bn1))))


class ResStage(nn.Module):
    def __init__(self, c_in: int, width: int, inners: tuple[int, ...]):
        super().__init__()
        self.transition = ConvBN(c_in, width, 3)
        self.blocks = nn.Sequential(*(ResBlock(width, inner) for inner in inners))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.transition(x))


class Net(nn.Module):
    """Any member or mother: stages in `layers`, max pooling between conv stages, a linear head over the
    flattened features (VGG-style; global average pooling loses the layout that small nets need)."""

    def __init__(self, arch: Arch):
        super().__init__()
        self.arch = arch
        c = arch.in_shape[0]
        stages: list[nn.Module] = []
        if isinstance(arch, VGG):
            for b, block in enumerate(arch.blocks):
                convs = []
                for i, conv in enumerate(block):
                    pool = i == len(block) - 1 and b < len(arch.blocks) - 1
                    convs.append(ConvBN(c, conv.width, conv.kernel, pool))
                    c = conv.width
                stages.append(nn.Sequential(*convs))
        elif isinstance(arch, ResNet):
            for stage in arch.stages:
                stages.append(ResStage(c, stage.width, stage.blocks))
                c = stage.width
        else:
            c = arch.in_shape[0] * arch.in_shape[1] * arch.in_shape[2]
            for width in arch.hidden:
                stages.append(LinearBN(c, width))
                c = width
        self.layers = nn.ModuleDict({str(i): stage for i, stage in enumerate(stages)})
        if isinstance(arch, MLP):
            self.head = nn.Linear(c, arch.num_classes)
        else:  # a linear layer over the flattened last feature map, as a conv: dim 1 is still the channel
            self.head = nn.Conv2d(c, arch.num_classes, final_size(arch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.arch, MLP):
            x = x.flatten(1)
            for stage in self.layers.values():
                x = stage(x)
            return self.head(x)
        x = to_channels_last(x)
        for i, stage in enumerate(self.layers.values()):
            # A VGG block pools in its last layer; ResNet stages pool here.
            x = F.max_pool2d(x, 2) if i and isinstance(self.arch, ResNet) else x
            x = stage(x)
        # The head conv covers the whole map, so it is a matmul over the flattened features: as F.linear its
        # forward and backward cost half of what a full-map convolution does on CPU (a fixed cost of every step,
        # which weighs most on the small mother). A fresh tensor, as FSDP2 wants (no in-place ops on a view).
        return F.linear(x.flatten(1), self.head.weight.flatten(1), self.head.bias)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """A Net keeps no non-persistent buffers (BatchNorm statistics are in its state dict)."""

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fresh initialization, also after `to_empty` (which leaves BN buffers uninitialized); the buffers are
        reset in place, so they stay on whatever device `buffer_device` names for titan."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)) and m is not self.head:
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            elif isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_parameters()
        nn.init.normal_(self.head.weight, std=self.head.weight[0].numel() ** -0.5)
        nn.init.zeros_(self.head.bias)


def build(arch: Arch) -> Net:
    net = Net(arch)
    net.init_weights()
    return net


def num_params(arch: Arch) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Net(arch).parameters())
