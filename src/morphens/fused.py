"""Training-mode BatchNorm + ReLU, 2x2 max pooling and one-channel convolutions in C, for the small conv nets
morphens trains on a CPU.

Why: at 6-35 channels a net's step on a CPU goes less to its FLOPs than to memory-bound layers and oneDNN's
weakest case. For the fashion sweep's mother with ATen's kernels, max_pool2d took 22% of a step, BatchNorm and ReLU
(forward and backward) 23%, and its first convolution (one input channel) ran at 3-6 GFLOP/s. In C, on this 2-core
box: BatchNorm + ReLU about 4.5x less time, the pooling about 3x, that convolution about 2x. A mother gains more
than a member, since its activations weigh more against its FLOPs.

The C code serves float32 CPU tensors, channels-first or channels-last (a net keeps its input's layout; morphens'
nets run channels-last, where oneDNN's convolutions are faster), with torch on one thread (morphens' default: the
kernels are serial), in eager mode. Elsewhere (other dtypes or devices, DTensors, strided views, more threads,
torch.compile, no C compiler) the torch ops run. Results agree: the pooling's values and gradients equal torch's
bit for bit, BatchNorm's and the convolution's to float rounding (their sums run in another order). The library
is built on first use into $MORPHENS_CACHE_DIR/native (default ~/.cache/morphens), about a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from titan.tools.native import FLAGS, LIBS, build_once, compiler, processor

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kernels.c")
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "bn_relu_forward_f32": [_P] * 6 + [_I] * 3 + [_D],
    "bn_relu_backward_f32": [_P] * 9 + [_I] * 3 + [_D],
    "bn_relu_forward_nhwc_f32": [_P] * 6 + [_I] * 2 + [_D],
    "bn_relu_backward_nhwc_f32": [_P] * 9 + [_I] * 2 + [_D],
    "max_pool2_forward_f32": [_P] * 3 + [_I] * 3,
    "max_pool2_backward_f32": [_P] * 3 + [_I] * 3,
    "max_pool2_forward_nhwc_f32": [_P] * 3 + [_I] * 4,
    "max_pool2_backward_nhwc_f32": [_P] * 3 + [_I] * 4,
    "conv1_forward_f32": [_P] * 3 + [_I] * 6,
    "conv1_weight_grad_f32": [_P] * 4 + [_I] * 6,
}
RETURNS = {name: ctypes.c_int for name in SIGNATURES if "nhwc" in name or name.startswith("conv1")}
"""The kernels that allocate scratch, and return 0 where they cannot."""
FALLBACK = "BatchNorm + ReLU and max pooling run as torch ops (slower)"


def build_command(cc: str, out: Path) -> list[str]:
    return [cc, *FLAGS, str(SOURCE), "-o", str(out), *LIBS]


def library_path(cc: str) -> Path:
    """One file per source, compiler, flags and processor."""
    key = hashlib.sha256(SOURCE.read_bytes() + f"{build_command(cc, Path('out'))} {processor()}".encode())
    cache = Path(os.environ.get("MORPHENS_CACHE_DIR") or Path.home() / ".cache" / "morphens")
    return cache / "native" / f"kernels-{key.hexdigest()[:16]}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot be built or loaded here."""
    cc = compiler()
    if cc is None:
        logger.warning(f"morphens: no C compiler (cc, gcc or clang, or $CC); {FALLBACK}")
        return None
    path = library_path(cc)
    error = build_once(path, lambda out: build_command(cc, out))
    if error is not None:
        logger.warning(f"morphens: building {SOURCE.name} with {cc} into {path.parent} failed ({error}); {FALLBACK}")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # a damaged file, or one built against another C library on a shared home
        logger.warning(f"morphens: loading {path} failed ({e}); {FALLBACK}; delete it to rebuild")
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, RETURNS.get(name)
    return lib


def _served(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels take these tensors here (plain CPU float32 tensors, one thread, eager mode)."""
    return (all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
                for t in tensors)
            and torch.get_num_threads() == 1 and not torch.compiler.is_compiling() and library() is not None)


def channels_last(x: torch.Tensor) -> bool | None:
    """How a (N, C, H, W) tensor lies in memory for the kernels: True channels-last, False channels-first, None
    neither (a strided view). Read from the strides as oneDNN does, so that one channel can be either."""
    if x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last):
        return True
    return False if x.is_contiguous() else None


def _dense(t: torch.Tensor, nhwc: bool) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last if nhwc else torch.contiguous_format)


def _empty(shape: tuple[int, ...], nhwc: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized (N, C, H, W) tensor in the given layout."""
    if not nhwc:
        return torch.empty(shape, dtype=dtype)
    n, c, h, w = shape
    return torch.empty(n, h, w, c, dtype=dtype).permute(0, 3, 1, 2)


def _call(kernel: str, *args) -> None:
    """Runs a kernel of kernels.c, passing tensors as their data pointers."""
    if getattr(library(), kernel)(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)) == 0:
        raise MemoryError(f"morphens.fused: {kernel} could not allocate its scratch")


class _BatchNormReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, nhwc: bool):
        y, mean, var = torch.empty_like(x), x.new_empty(x.shape[1]), x.new_empty(x.shape[1])
        B, C = x.shape[:2]
        if nhwc:
            _call("bn_relu_forward_nhwc_f32", x, y, weight, bias, mean, var, x.numel() // C, C, eps)
        else:
            _call("bn_relu_forward_f32", x, y, weight, bias, mean, var, B, C, x[0, 0].numel(), eps)
        ctx.save_for_backward(x, y, weight, mean, var)
        ctx.eps, ctx.nhwc = eps, nhwc
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor, _dmean, _dvar):
        x, y, weight, mean, var = ctx.saved_tensors
        dy, dx = _dense(dy, ctx.nhwc), torch.empty_like(x)
        dweight, dbias = torch.empty_like(weight), torch.empty_like(weight)
        B, C = x.shape[:2]
        if ctx.nhwc:
            _call("bn_relu_backward_nhwc_f32", x, y, dy, dx, weight, mean, var, dweight, dbias, x.numel() // C, C,
                  ctx.eps)
        else:
            _call("bn_relu_backward_f32", x, y, dy, dx, weight, mean, var, dweight, dbias, B, C, x[0, 0].numel(),
                  ctx.eps)
        return dx, dweight, dbias, None, None


def bn_relu(x: torch.Tensor, bn: nn.modules.batchnorm._BatchNorm) -> torch.Tensor:
    """`F.relu(bn(x))`, with its running statistics updated as `bn` would in training mode."""
    nhwc = channels_last(x) if x.dim() == 4 else None
    fused = (bn.training and bn.affine and bn.track_running_stats and bn.momentum is not None and nhwc is not None
             and x.numel() > x.shape[1] and _served(x, bn.weight, bn.bias))
    if not fused:
        return F.relu(bn(x))
    y, mean, var = _BatchNormReLU.apply(x, bn.weight, bn.bias, bn.eps, nhwc)
    with torch.no_grad():
        n = x.numel() // x.shape[1]
        bn.running_mean.lerp_(mean, bn.momentum)
        bn.running_var.lerp_(var * (n / (n - 1)), bn.momentum)  # the running variance is the unbiased one
        bn.num_batches_tracked.add_(1)
    return y


class _MaxPool2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, nhwc: bool):
        B, C, H, W = x.shape
        out, which = _empty((B, C, H // 2, W // 2), nhwc), _empty((B, C, H // 2, W // 2), nhwc, torch.uint8)
        if nhwc:
            _call("max_pool2_forward_nhwc_f32", x, out, which, B, H, W, C)
        else:
            _call("max_pool2_forward_f32", x, out, which, B * C, H, W)
        ctx.save_for_backward(which)
        ctx.in_shape, ctx.nhwc = x.shape, nhwc
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: torch.Tensor):
        (which,) = ctx.saved_tensors
        B, C, H, W = ctx.in_shape
        dout, dx = _dense(dout, ctx.nhwc), _empty(ctx.in_shape, ctx.nhwc)
        if ctx.nhwc:
            _call("max_pool2_backward_nhwc_f32", dout, which, dx, B, H, W, C)
        else:
            _call("max_pool2_backward_f32", dout, which, dx, B * C, H, W)
        return dx, None


def max_pool2(x: torch.Tensor) -> torch.Tensor:
    """`F.max_pool2d(x, 2)` of a (N, C, H, W) tensor."""
    nhwc = channels_last(x) if x.dim() == 4 else None
    if nhwc is not None and min(x.shape[-2:]) >= 2 and x.numel() and _served(x):
        return _MaxPool2.apply(x, nhwc)
    return F.max_pool2d(x, 2)


class _Conv1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, nhwc: bool):
        (B, _, H, W), (C, _, K, _) = x.shape, weight.shape
        y = _empty((B, C, H, W), nhwc)
        _call("conv1_forward_f32", x, weight, y, B, C, H, W, K, nhwc)
        ctx.save_for_backward(x, weight)
        ctx.nhwc = nhwc
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        (B, _, H, W), (C, _, K, _) = x.shape, weight.shape
        dy, dweight = _dense(dy, ctx.nhwc), torch.empty_like(weight)
        _call("conv1_weight_grad_f32", x, dy, dweight, torch.empty(C * K * K, dtype=torch.float64), B, C, H, W, K,
              ctx.nhwc)
        dx = torch.nn.grad.conv2d_input(x.shape, weight, dy, padding=K // 2) if ctx.needs_input_grad[0] else None
        return dx, dweight, None


def conv(x: torch.Tensor, conv2d: nn.Conv2d) -> torch.Tensor:
    """`conv2d(x)`; in C for one input channel (a grayscale net's first layer, where oneDNN's kernels run at a few
    GFLOP/s), stride 1, odd square kernel, "same" zero padding and no bias. The output takes the input's layout."""
    k = conv2d.kernel_size[0]
    nhwc = channels_last(x) if x.dim() == 4 else None
    if (conv2d.in_channels == 1 and conv2d.kernel_size == (k, k) and k % 2 and conv2d.padding == (k // 2, k // 2)
            and conv2d.stride == (1, 1) and conv2d.dilation == (1, 1) and conv2d.groups == 1 and conv2d.bias is None
            and conv2d.padding_mode == "zeros" and nhwc is not None and x.numel() and conv2d.weight.is_contiguous()
            and conv2d.out_channels * x.shape[-2] * (x.shape[-1] + k) < 2**31  # the C planes' int32 offsets
            and _served(x, conv2d.weight)):
        return _Conv1.apply(x, conv2d.weight, nhwc)
    return conv2d(x)
