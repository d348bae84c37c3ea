import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference.decode import fold_norm, ring_window, rms_scale


def test_folded_norm_then_projection_equals_the_modules():
    torch.manual_seed(0)
    norm, W = nn.RMSNorm(8, eps=1e-5).double(), torch.randn(5, 8, dtype=torch.float64)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 8, dtype=torch.float64)
    folded = (x * rms_scale(x, 8 * norm.eps)) @ fold_norm(norm, W)
    torch.testing.assert_close(folded, F.linear(norm(x), W), rtol=0, atol=1e-12)


def test_ring_holds_each_of_the_last_K_inputs_at_its_position_mod_K():
    K = 3
    for P in (1, 2, 3, 4, 8):
        u_BCP = torch.arange(1.0, P + 1).expand(2, 4, P)  # input tau has value tau + 1
        ring = ring_window(u_BCP, K)
        assert ring.shape == (K, 2, 4)
        for tau in range(P - K, P):
            assert (ring[tau % K] == max(tau + 1, 0)).all()  # zeros stand for the positions before the start
