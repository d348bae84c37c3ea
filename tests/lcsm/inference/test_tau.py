
import pytest
import torch

from lcsm.inference.tau import TAUS, build_tau, triton_available


def brute_force_tile(y_RBU, rho_RL):
    R, B, U = y_RBU.shape
    out = torch.zeros_like(y_RBU)
    for m in range(U):
        for k in range(U):
            lag = U + m - k
            if lag < rho_RL.shape[1]:
                out[..., m] += y_RBU[..., k] * rho_RL[:, lag, None]
    return out


@pytest.mark.parametrize("name", ["direct", "fft", "conv1d", "hybrid"])
@pytest.mark.parametrize("U", [1, 2, 8, 32])
def test_tau_matches_brute_force(name, U):
    gen = torch.Generator().manual_seed(U)
    rho = torch.randn(6, 50, generator=gen, dtype=torch.float64)  # shorter than 2U for U = 32: zero lags beyond
    y = torch.randn(6, 3, U, generator=gen, dtype=torch.float64)
    tau = build_tau(name, rho)
    tau.prepare(U)
    torch.testing.assert_close(tau(y), brute_force_tile(y, rho), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["direct", "fft", "conv1d", "hybrid"])
def test_tau_of_some_rows_equals_those_rows_of_the_whole(name):
    gen = torch.Generator().manual_seed(0)
    rho, y = torch.randn(6, 40, generator=gen, dtype=torch.float64), torch.randn(6, 2, 8, generator=gen,
                                                                                  dtype=torch.float64)
    tau = build_tau(name, rho)
    tau.prepare(8)
    torch.testing.assert_close(tau.rows(2, 4)(y[2:4]), brute_force_tile(y[2:4], rho[2:4]), rtol=0, atol=1e-10)


def test_triton_without_support_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if triton_available(torch.device("cpu")):
        pytest.skip("Triton runs on this CPU")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        build_tau("triton", torch.randn(2, 8))


def test_unknown_tau():
    with pytest.raises(ValueError, match="unknown tau 'nope'; choose one of"):
        build_tau("nope", torch.randn(2, 8))


def test_registry_lists_every_tau():
    assert set(TAUS) == {"direct", "fft", "conv1d", "triton", "hybrid"}
