import torch
import torch.nn.functional as F
from torch import nn

from lcsm.inference.block_exit import fold_norm, rms_scale


def test_folded_norm_then_projection_equals_the_modules():
    torch.manual_seed(0)
    norm, W = nn.RMSNorm(8, eps=1e-5).double(), torch.randn(5, 8, dtype=torch.float64)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 8, dtype=torch.float64)
    folded = (x * rms_scale(x, 8 * norm.eps)) @ fold_norm(norm, W)
    torch.testing.assert_close(folded, F.linear(norm(x), W), rtol=0, atol=1e-12)
