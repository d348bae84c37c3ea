import pytest
import torch

from lcsm.inference.engines import ENGINES, build_engine
from lcsm.model.fftconv import fft_causal_conv

CONFIGS = [
    ("lazy", {}),
    ("lazy", {"native_step": False}),
    ("eager", {}),
    ("recompute", {}),
    ("flash", {"tau": "fft", "block": 1}),
    ("flash", {"tau": "direct", "block": 2}),
    ("flash", {"tau": "conv1d", "block": 4, "batch_layers": False}),
    ("flash", {"tau": "hybrid"}),
    ("flash", {"tau": "fft", "block": 8, "batch_layers": True}),
    ("flash", {"tau": "fft", "block": 4, "native_step": False}),
    ("flash", {"tau": "hybrid", "native_step": False}),
]
"""Lazy and flash steps in C where this machine can build it (lcsm.inference.accel.native), and as tensor ops."""


def run(engine, y_GBDL, P):
    """Prefill P steps (if P > 0), then step the rest, slot by slot."""
    G, L = y_GBDL.shape[0], y_GBDL.shape[-1]
    z = torch.empty_like(y_GBDL)
    for g in range(G if P else 0):
        z[g, ..., :P] = engine.prefill(y_GBDL[g, ..., :P], slot=g)
    for t in range(P, L):
        for g in range(G):
            z[g, ..., t] = engine.step(y_GBDL[g, ..., t], slot=g)
    return z


@pytest.mark.parametrize("name,options", CONFIGS)
# (200, 70): flash's default block (64) with its C step, whose own tile of 64 lands whole at 64 and cut short
# at 192 (8 outputs left).
@pytest.mark.parametrize("L,P", [(1, 0), (2, 1), (16, 0), (37, 0), (37, 1), (37, 20), (64, 64), (64, 33),
                                 (200, 70)])
def test_engine_equals_fft_convolution_float64(name, options, L, P):
    gen = torch.Generator().manual_seed(L + P)
    G, B, D = 3, 2, 4
    rho = torch.randn(G, D, L, generator=gen, dtype=torch.float64)
    y = torch.randn(G, B, D, L, generator=gen, dtype=torch.float64)
    z = run(build_engine(name, rho, B, **options), y, P)
    torch.testing.assert_close(z, fft_causal_conv(y, rho[:, None]), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,options", CONFIGS)
def test_engine_float32_feedback(name, options):
    """y_t depends on z_{t-1} through a nonlinearity, so every output must be ready when the next input needs it."""
    gen = torch.Generator().manual_seed(0)
    L, B, D = 100, 2, 3
    rho = torch.randn(1, D, L, generator=gen) * torch.exp(-torch.arange(L) / 20.0)
    x = torch.randn(B, D, L, generator=gen)

    def feedback(engine_step):
        y, z = torch.zeros(B, D, L, dtype=rho.dtype), torch.zeros(B, D, L, dtype=rho.dtype)
        for t in range(L):
            y[..., t] = x[..., t] + torch.tanh(z[..., t - 1]) if t else x[..., 0]
            z[..., t] = engine_step(y[..., t].contiguous(), t)
        return y, z

    def exact_step(y_t, t, y_hist=[]):  # noqa: B006 - the reference recomputes the whole convolution
        y_hist.append(y_t.double())
        return fft_causal_conv(torch.stack(y_hist, -1), rho[0].double())[..., -1].to(rho.dtype)

    engine = build_engine(name, rho, B, **options)
    y, z = feedback(lambda y_t, t: engine.step(y_t))
    y_ref, z_ref = feedback(exact_step)
    torch.testing.assert_close(z, z_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z, fft_causal_conv(y.double(), rho[0].double()).float(), rtol=1e-4, atol=1e-4)


def test_flash_tiles_batched_over_slots_equal_per_slot_and_the_choice_is_reported():
    gen = torch.Generator().manual_seed(1)
    rho, y = torch.randn(4, 3, 50, generator=gen), torch.randn(4, 1, 3, 50, generator=gen)
    batched = run(build_engine("flash", rho, 1, tau="fft", block=1), y, 5)
    per_layer = run(build_engine("flash", rho, 1, tau="fft", block=1, batch_layers=False), y, 5)
    torch.testing.assert_close(batched, per_layer, rtol=1e-6, atol=1e-6)
    chosen = build_engine("flash", rho, 1, tau="hybrid", block=4)
    torch.testing.assert_close(run(chosen, y, 5), batched, rtol=1e-5, atol=1e-5)
    plan = chosen.describe()
    assert list(plan) == [4, 8, 16, 32]
    for U, how in plan.items():
        if U <= chosen.c_tiles:  # the smallest tiles, done by the C step after its block
            assert how == "C, in the step"
            continue
        tau, batching = how.split(", ")
        assert tau in ("fft", "direct", "conv1d") and batching == ("all slots" if chosen.batched[U] else "per slot")


@pytest.mark.parametrize("name", list(ENGINES))
def test_step_checks_shape_and_slot_every_time(name):
    engine = build_engine(name, torch.randn(3, 4, 8), 2)
    with pytest.raises(ValueError, match=r"input must have shape \(2, 4\), got \(1, 4\)"):
        engine.step(torch.randn(1, 4))  # would broadcast silently
    for slot in (-1, 3):
        with pytest.raises(ValueError, match=r"slot must be in \[0, 3\), got " + str(slot)):
            engine.step(torch.randn(2, 4), slot)
    assert engine.pos == 0


@pytest.mark.parametrize("name,options", CONFIGS)
def test_step_writes_into_out_where_given_and_refuses_a_wrong_one(name, options):
    gen = torch.Generator().manual_seed(3)
    rho, y = torch.randn(2, 4, 20, generator=gen), torch.randn(20, 2, 3, 4, generator=gen)
    fresh, into = build_engine(name, rho, 3, **options), build_engine(name, rho, 3, **options)
    for t in range(20):
        for g in range(2):
            z, out = fresh.step(y[t, g], g), torch.empty(3, 4)
            assert into.step(y[t, g], g, out=out) is out
            torch.testing.assert_close(out, z, rtol=0, atol=0)
    engine = build_engine(name, rho, 3, **options)
    wrong = {r"got \(3, 5\)": torch.empty(3, 5), "got \\(3, 4\\) torch.float64": torch.empty(3, 4, dtype=torch.float64),
             r"got \(3, 4\) torch.float32 on cpu \(not contiguous\)": torch.empty(4, 3).T}
    for message, out in wrong.items():
        with pytest.raises(ValueError, match=r"out must be a contiguous \(3, 4\) tensor of torch.float32 on cpu, "
                           + message):
            engine.step(y[0, 0], out=out)
    assert engine.pos == 0


@pytest.mark.parametrize("name", list(ENGINES))
def test_bad_input_names_the_fix(name):
    rho = torch.randn(1, 2, 8)
    engine = build_engine(name, rho, 1)
    with pytest.raises(ValueError, match="prompt length must be in \\[1, 8\\]"):
        engine.prefill(torch.randn(1, 2, 9))
    with pytest.raises(ValueError, match="convert one to match"):
        engine.step(torch.randn(1, 2, dtype=torch.float64))
    for _ in range(8):
        engine.step(torch.randn(1, 2))
    with pytest.raises(ValueError, match="longer filter"):
        engine.step(torch.randn(1, 2))
    with pytest.raises(ValueError, match="batch must be >= 1"):
        build_engine(name, rho, 0)
    with pytest.raises(ValueError, match="every size >= 1"):
        build_engine(name, torch.randn(1, 2, 0), 1)


def test_unknown_engine_and_options():
    with pytest.raises(ValueError, match="unknown engine 'slow'; choose one of lazy, eager, recompute, flash"):
        build_engine("slow", torch.randn(1, 1, 4), 1)
    with pytest.raises(ValueError, match="apply to the flash engine only"):
        build_engine("lazy", torch.randn(1, 1, 4), 1, tau="fft")
    with pytest.raises(ValueError, match="unknown tau"):
        build_engine("flash", torch.randn(1, 1, 4), 1, tau="fast")
    with pytest.raises(ValueError, match="power of two"):
        build_engine("flash", torch.randn(1, 1, 4), 1, block=3)
