import math

import numpy as np
import torch

from lcsm.model.hyenadna import CharacterTokenizer, DNAMixer, HyenaDNAArgs, positional_features


def test_positional_features_are_the_complex_exponential_bands():
    """z = [t, Re, Im] of exp(-i f_b w_k), w_k = 2 pi k / l_max, f_b = linspace(1e-4, bands - 1, bands)."""
    L, E = 37, 7
    z, t = positional_features(L, E)
    k = np.arange(L)
    bands = np.exp(-1j * np.linspace(1e-4, 2, 3)[None] * (2 * math.pi * k / L)[:, None])
    np.testing.assert_allclose(t.numpy(), k / (L - 1), atol=1e-6)
    np.testing.assert_allclose(z.numpy(), np.concatenate([(k / (L - 1))[:, None], bands.real, bands.imag], 1),
                               atol=1e-5)


def test_mixer_equals_a_direct_evaluation_of_the_recurrence():
    """Order 3, by loops in numpy: u = short conv(in_proj x) split into gates x0 x1 x2 and value v; two long
    convolutions v <- h_o * (v x_{2-o}) + D_o (v x_{2-o}); out_proj(v x0)."""
    torch.manual_seed(0)
    args = HyenaDNAArgs(d_model=3, l_max=9, order=3, filter_order=4, emb_dim=3, shift=0.1)
    mixer = DNAMixer(args).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    B, T, D, K = 2, 9, 3, 3
    x = torch.randn(B, T, D, dtype=torch.float64)
    inp = (x @ mixer.in_proj.weight.T + mixer.in_proj.bias).detach().numpy()  # (B, T, 4D)
    w, b = mixer.short_filter.weight.detach().numpy()[:, 0], mixer.short_filter.bias.detach().numpy()
    u = np.zeros_like(inp)
    for t in range(T):
        for lag in range(K):
            if t - lag >= 0:
                u[:, t] += w[:, K - 1 - lag] * inp[:, t - lag]
    u += b
    x0, x1, x2, v = (u[..., i * D : (i + 1) * D] for i in range(4))
    h = mixer.filter(T).detach().numpy().reshape(2, D, T)
    Dskip = mixer.filter.D.detach().numpy().reshape(2, D)
    for o, gate in enumerate((x2, x1)):
        y = v * gate
        v = np.zeros_like(y)
        for t in range(T):
            for j in range(t + 1):
                v[:, t] += h[o, :, t - j] * y[:, j]
        v += Dskip[o] * y
    want = (v * x0) @ mixer.out_proj.weight.detach().numpy().T + mixer.out_proj.bias.detach().numpy()
    np.testing.assert_allclose(mixer(x).detach().numpy(), want, atol=1e-12)


def test_filter_is_the_modulated_mlp_of_the_features():
    torch.manual_seed(0)
    args = HyenaDNAArgs(d_model=2, l_max=11, filter_order=5, emb_dim=3, num_inner_mlps=1, shift=0.05)
    f = DNAMixer(args).filter.double()
    a = torch.sin(f.freq * f.mlp[0](f.z))
    a = torch.sin(f.freq * f.mlp[1](a))
    decay = torch.exp(-f.t[:, None] * f.deltas.abs()) + 0.05
    torch.testing.assert_close(f(11), (f.proj(a) * decay).T, rtol=0, atol=1e-15)
    assert math.isclose(f.deltas[0], math.log(0.01) / 1.5, rel_tol=1e-6)
    assert math.isclose(f.deltas[-1], math.log(0.01) / 0.3, rel_tol=1e-6)


def test_character_tokenizer_uses_hyenadnas_ids():
    tok = CharacterTokenizer()
    assert tok.vocab_size == 12
    assert tok.encode("ACGTNx") == [7, 8, 9, 10, 11, 6]
    assert tok.decode([7, 10, 2, 15]) == "AT[BOS][PAD]"
