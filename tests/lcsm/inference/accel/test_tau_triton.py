"""The Triton Toeplitz tile, run in Triton's CPU interpreter: out[r, b, m] = sum_k y[r, b, k] * rho[r, U + m - k]."""

import os
import subprocess
import sys

import numpy as np
import pytest
from packaging.version import Version

# U = 70 takes two blocks of 64 outputs, the second one masked. The taus' filter has 40 lags (padded to 128 <
# 2U): lags beyond it count as zero, as in fft; an unmasked kernel read past the end there.
TRITON_CHECK = """
import torch
from lcsm.inference.tau import build_tau
from lcsm.inference.accel.tau_triton import toeplitz_tile
gen = torch.Generator().manual_seed(0)
rho = torch.randn(2, 160, generator=gen)
fft, triton_tau = build_tau("fft", rho[:, :40]), build_tau("triton", rho[:, :40])
for U in (1, 4, 16, 70):
    y = torch.randn(2, 3, U, generator=gen)
    lag = U + torch.arange(U)[:, None] - torch.arange(U)[None, :]
    by_formula = torch.einsum("rbk,rmk->rbm", y, rho[:, lag])
    torch.testing.assert_close(toeplitz_tile(y, rho), by_formula, rtol=1e-5, atol=1e-5)
    fft.prepare(U)
    triton_tau.prepare(U)
    torch.testing.assert_close(triton_tau(y), fft(y), rtol=1e-5, atol=1e-5)
"""

# The kernel's row offsets at the int32 boundary: row 2^20 of 2^12 elements starts at 2^32 (an int32 product wraps
# to 0), and the last row of a tile with R * B * U = 2^31 + 2^11 ends past 2^31.
OFFSET_CHECK = """
import torch
import triton
import triton.language as tl
from lcsm.inference.accel.tau_triton import row_start
start_of = row_start()

@triton.jit
def probe(out_ptr, i, n):
    tl.store(out_ptr, start_of(i, n))

out = torch.zeros(1, dtype=torch.int64)
for i, n in ((2**20, 2**12), (2**19 + 1, 2**12), (3, 5)):
    probe[(1,)](out, i, n)
    assert out.item() == i * n, (i, n, out.item())
"""


def _interpret(script: str) -> None:
    """Triton reads TRITON_INTERPRET when it is imported, hence a fresh process."""
    triton = pytest.importorskip("triton")
    if Version(triton.__version__) < Version("3.7") and Version(np.__version__) >= Version("2.4"):
        # Its interpreter calls int() on 1-element arrays, an error since numpy 2.4 (it passes with numpy 2.3);
        # compiled for a GPU the kernel does not go through the interpreter.
        pytest.skip(f"Triton {triton.__version__}'s interpreter fails under numpy {np.__version__}; needs numpy < 2.4")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_kernel_in_interpreter_matches_the_formula_and_triton_tau_matches_fft():
    _interpret(TRITON_CHECK)


def test_row_offsets_are_int64_past_2_31():
    _interpret(OFFSET_CHECK)
