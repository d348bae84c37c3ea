"""The Toeplitz tile as a Triton kernel: one program per (row, batch) pair and block of outputs."""

import functools

import torch
import triton
import triton.language as tl


def _start_of(i, n):
    return i.to(tl.int64) * n


@functools.cache
def row_start():
    """The jit function `start_of(i, n)`: the offset i * n of row i of n elements, in int64 (program ids and sizes
    are int32, and R * B * U reaches 2^31, e.g. 2048 rows x 2^20 tile elements)."""
    global start_of  # a kernel finds the jit functions it calls among its module's globals
    start_of = triton.jit(_start_of)
    return start_of


@functools.cache
def _kernel():
    # Defined on first use so that TRITON_INTERPRET, read when a kernel is defined, can be set by then.
    row_start()

    @triton.jit
    def toeplitz_tile_kernel(y_ptr, rho_ptr, out_ptr, B, U, L, rho_stride, BLOCK_M: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        row_batch = tl.program_id(0)
        y_start = start_of(row_batch, U)
        rho_start = start_of(row_batch // B, rho_stride)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros([BLOCK_M], dtype=out_ptr.dtype.element_ty)
        for k0 in range(0, U, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            y = tl.load(y_ptr + y_start + k, mask=k < U, other=0.0)
            lag = U + m[:, None] - k[None, :]
            in_tile = (m[:, None] < U) & (k[None, :] < U) & (lag < L)  # lags beyond the filter are zero
            rho = tl.load(rho_ptr + rho_start + lag, mask=in_tile, other=0.0)
            acc += tl.sum(rho * y[None, :], axis=1)
        tl.store(out_ptr + y_start + m, acc, mask=m < U)

    return toeplitz_tile_kernel


def toeplitz_tile(y_RBU: torch.Tensor, rho_RL: torch.Tensor) -> torch.Tensor:
    """out[r, b, m] = sum_k y[r, b, k] * rho[r, U + m - k], zero for lags from the length L of rho on; y and rho
    contiguous."""
    R, B, U = y_RBU.shape
    out = torch.empty_like(y_RBU)
    block_m = min(64, max(16, U))
    grid = (R * B, (U + block_m - 1) // block_m)
    _kernel()[grid](y_RBU, rho_RL, out, B, U, rho_RL.shape[1], rho_RL.stride(0), BLOCK_M=block_m, BLOCK_K=block_m)
    return out
