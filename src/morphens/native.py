"""BatchNorm + ReLU (+ the 2x2 max pooling after a VGG block) in one C pass each way, for morphens' small conv nets
in training on a CPU (native.c).

Why: at 6-30 channels a net's step goes less to its convolutions than to the memory-bound layers around them,
and torch's channels-last BatchNorm and max pooling loop over a few channels at a time. The mothers, whose
activations weigh most against their FLOPs, gain most (benchmarks/RESULTS.md has the measurement that keeps this
module). One switch: `MORPHENS_NATIVE=0` runs torch's ops (models.bn_relu and F.max_pool2d), the tested
reference. Served: training steps (grad enabled, BatchNorm in training mode; not the no-grad calibration of
morphisms, which reads a layer's output before its pooling) on float32 channels-last CPU tensors, one torch
thread, eager mode, with a C compiler to build the library on first use into $MORPHENS_CACHE_DIR/native (default
~/.cache/morphens, about a second); elsewhere the torch ops run. The pooling's choices equal torch's (the first
maximum of each window); values and gradients agree with torch's to float rounding (sums in another order, in
double).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from titan.tools.native import FLAGS, LIBS, build_once, compiler, processor

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("native.c")
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {"bn_relu_pool_forward": [_P] * 8 + [_I] * 4 + [_D, ctypes.c_int],
              "bn_relu_pool_backward": [_P] * 11 + [_I] * 4 + [_D, ctypes.c_int]}


def enabled() -> bool:
    """The one switch: MORPHENS_NATIVE=0 turns the C path off."""
    return os.environ.get("MORPHENS_NATIVE", "1") != "0"


def build_command(cc: str, out: Path) -> list[str]:
    return [cc, *FLAGS, str(SOURCE), "-o", str(out), *LIBS]


def library_path(cc: str) -> Path:
    """One file per source, compiler, flags and processor."""
    key = hashlib.sha256(SOURCE.read_bytes() + f"{build_command(cc, Path('out'))} {processor()}".encode())
    cache = Path(os.environ.get("MORPHENS_CACHE_DIR") or Path.home() / ".cache" / "morphens")
    return cache / "native" / f"native-{key.hexdigest()[:16]}.so"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library, or None (logged once) where it cannot be built or loaded here."""
    fallback = "BatchNorm + ReLU and max pooling run as torch ops"
    cc = compiler()
    if cc is None:
        logger.warning(f"morphens: no C compiler (cc, gcc or clang, or $CC); {fallback}")
        return None
    path = library_path(cc)
    error = build_once(path, lambda out: build_command(cc, out))
    if error is not None:
        logger.warning(f"morphens: building {SOURCE.name} with {cc} into {path.parent} failed ({error}); {fallback}")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # a damaged file, or one built against another C library on a shared home
        logger.warning(f"morphens: loading {path} failed ({e}); {fallback}; delete it to rebuild")
        return None
    for name, argtypes in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int
    return lib


def served(x: torch.Tensor, bn: nn.BatchNorm2d) -> bool:
    """Whether the C path takes relu(bn(x)) here: training steps (grad enabled, BatchNorm in training mode)."""
    return (enabled() and bn.training and torch.is_grad_enabled() and bn.affine and bn.track_running_stats
            and bn.momentum is not None and x.dim() == 4 and x.shape[1] == bn.num_features
            and x.shape[1] < x.numel() < 2**31  # the C code's int32 offsets of the pooling's winners
            and x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last)
            and all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
                    for t in (x, bn.weight, bn.bias))
            and torch.get_num_threads() == 1 and not torch.compiler.is_compiling() and library() is not None)


def _nhwc(n: int, c: int, h: int, w: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized (n, c, h, w) tensor in channels-last memory."""
    return torch.empty(n, h, w, c, dtype=dtype).permute(0, 3, 1, 2)


def _call(name: str, *args) -> None:
    if getattr(library(), name)(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)) == 0:
        raise MemoryError(f"morphens.native: {name} could not allocate its scratch")


class _BatchNormReLUPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, weight, bias, eps, pool):
        n, c, h, w = z.shape
        y = _nhwc(n, c, h // 2, w // 2) if pool else _nhwc(n, c, h, w)
        at = _nhwc(n, c, h // 2, w // 2, torch.int32) if pool else z.new_empty(0, dtype=torch.int32)
        z_at = _nhwc(n, c, h // 2, w // 2) if pool else z.new_empty(0)
        mean, var = z.new_empty(c), z.new_empty(c)
        _call("bn_relu_pool_forward", z, y, at, z_at, weight, bias, mean, var, n, h, w, c, eps, int(pool))
        ctx.save_for_backward(z, at, z_at, weight, bias, mean, var)
        ctx.eps, ctx.pool = eps, pool
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, _dmean, _dvar):
        z, at, z_at, weight, bias, mean, var = ctx.saved_tensors
        dy = dy.contiguous(memory_format=torch.channels_last)
        dz, dweight, dbias = torch.empty_like(z), torch.empty_like(weight), torch.empty_like(weight)
        n, c, h, w = z.shape
        _call("bn_relu_pool_backward", z, dy, at, z_at, dz, weight, bias, mean, var, dweight, dbias, n, h, w, c,
              ctx.eps, int(ctx.pool))
        return dz, dweight, dbias, None, None


def bn_relu_pool(z: torch.Tensor, bn: nn.BatchNorm2d, pool: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """relu(bn(z)), max-pooled 2x2 if `pool`, where `served(z, bn)`, and the batch's mean and biased variance (for
    bn's running statistics: models.update_running_stats)."""
    return _BatchNormReLUPool.apply(z, bn.weight, bn.bias, bn.eps, pool)
