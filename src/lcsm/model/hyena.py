"""Hyena language model: single-device PyTorch, parallelized from outside (see lcsm.model.spec).

Channel-major layouts (in_proj output [d, p], filter channels [d, n]) keep every channel's projections and filters
together, so a contiguous tensor-parallel shard of the channels is a self-contained slice of the mixer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lcsm.model.fftconv import fft_causal_conv


@dataclass
class HyenaArgs:
    dim: int = 256
    n_layers: int = 4
    vocab_size: int = 4096
    order: int = 2
    """Long convolutions per mixer (N); in_proj makes N + 1 projections: the value and N gates."""
    max_seq_len: int = 2048
    """Filter length: the longest sequence the model trains on or generates."""
    short_kernel: int = 3
    filter_emb_dim: int = 33
    """Positional features of the implicit filter: t plus (filter_emb_dim - 1) / 2 sin/cos bands."""
    filter_hidden: int = 64
    filter_freq: float = 1.0
    """Initial frequency of the sine activations of the filter MLP."""
    decay_range: tuple[float, float] = field(default=(0.3, 1.5))
    """Fastest and slowest filter decay, as the fraction of max_seq_len after which |h| falls to 1 %."""
    mlp_ratio: int = 4
    norm_eps: float = 1e-5


LongConv = Callable[[torch.Tensor, int], torch.Tensor]
"""`(v_BDL, n) -> z_BDL`: a mixer's n-th causal long convolution."""


def local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a tensor-parallel parameter (the parameter itself when not distributed)."""
    return p.to_local() if isinstance(p, DTensor) else p


class Sin(nn.Module):
    def __init__(self, dim: int, freq: float):
        super().__init__()
        self.init_freq = freq
        self.freq = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.freq * x)

    def init_weights(self) -> None:
        nn.init.constant_(self.freq, self.init_freq)


class ImplicitFilter(nn.Module):
    """h[c, k] = MLP(features(k))[c] * exp(-|decay_c| t_k) + bias_c [k == 0]; depends on the position k only.

    The per-channel bias is the mixer's skip term (D in the Hyena paper); folding it into lag 0 makes the filter the
    whole linear map, which is what the online engines consume.
    """

    def __init__(self, channels: int, args: HyenaArgs):
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.emb_dim = args.filter_emb_dim
        self.decay_range = args.decay_range
        H = args.filter_hidden
        self.mlp = nn.Sequential(
            nn.Linear(args.filter_emb_dim, H), Sin(H, args.filter_freq),
            nn.Linear(H, H), Sin(H, args.filter_freq),
            nn.Linear(H, H), Sin(H, args.filter_freq),
        )
        self.proj = nn.Linear(H, channels, bias=False)
        self.decay = nn.Parameter(torch.empty(channels))
        self.bias = nn.Parameter(torch.empty(channels))

    def features(self, L: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Positional features (L, emb_dim) and normalized time t (L,) of positions 0 .. L-1."""
        k = torch.arange(L, device=device, dtype=torch.float32)
        t = k / max(self.max_seq_len - 1, 1)
        bands = (self.emb_dim - 1) // 2
        freqs = torch.linspace(1e-4, bands - 1, bands, device=device)
        angle = 2 * math.pi * k[:, None] * freqs / self.max_seq_len
        return torch.cat([t[:, None], torch.cos(angle), -torch.sin(angle)], dim=-1), t

    def forward(self, L: int) -> torch.Tensor:
        """The filters of all local channels for lags 0 .. L-1: (channels, L)."""
        weight = self.proj.weight
        features, t = self.features(L, weight.device)
        h_LC = self.proj(self.mlp(features.to(self.mlp[0].weight.dtype)))
        h_CL = h_LC.T * torch.exp(-t * local(self.decay).abs()[:, None])
        return torch.cat([h_CL[:, :1] + local(self.bias)[:, None], h_CL[:, 1:]], dim=-1)

    def init_weights(self) -> None:
        for module in self.mlp:
            module.init_weights() if isinstance(module, Sin) else module.reset_parameters()
        self.proj.reset_parameters()
        # |h| falls to 1 % after a fraction f of max_seq_len when decay = ln(100) / f; random rates spread the
        # channels over the range (and initialize the same way under any sharding).
        fast, slow = self.decay_range
        nn.init.uniform_(self.decay, math.log(100) / slow, math.log(100) / fast)
        nn.init.normal_(self.bias)


class HyenaMixer(nn.Module):
    """z^0 = v; z^{n+1} = x^n * (h^n conv z^n) for n < N; out_proj(z^N), with v, x^n from in_proj + short conv."""

    def __init__(self, args: HyenaArgs):
        super().__init__()
        D, N = args.dim, args.order
        self.order = N
        self.in_proj = nn.Linear(D, (N + 1) * D)
        self.short_weight = nn.Parameter(torch.empty((N + 1) * D, 1, args.short_kernel))
        self.short_bias = nn.Parameter(torch.empty((N + 1) * D))
        self.filter = ImplicitFilter(N * D, args)
        self.out_proj = nn.Linear(D, D)

    def short_conv(self, u_BCL: torch.Tensor) -> torch.Tensor:
        w = local(self.short_weight)
        causal = F.conv1d(u_BCL, w, local(self.short_bias), padding=w.shape[-1] - 1, groups=u_BCL.shape[1])
        return causal[..., : u_BCL.shape[-1]]

    def forward(self, x_BLD: torch.Tensor, long_conv: LongConv | None = None) -> torch.Tensor:
        """`long_conv(v_BDL, n)` replaces the FFT convolution with filter n (an online engine's prefill)."""
        B, L, _ = x_BLD.shape
        u = self.short_conv(self.in_proj(x_BLD).transpose(1, 2)).view(B, -1, self.order + 1, L)
        if long_conv is None:
            rho = self.filter(L).view(-1, self.order, L)

            def long_conv(v: torch.Tensor, n: int) -> torch.Tensor:
                return fft_causal_conv(v, rho[:, n])

        v = u[:, :, 0]
        for n in range(self.order):
            v = u[:, :, n + 1] * long_conv(v, n)
        return self.out_proj(v.transpose(1, 2))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.in_proj.weight, std=0.02)
        nn.init.trunc_normal_(self.out_proj.weight, std=init_std)
        nn.init.zeros_(self.in_proj.bias)
        nn.init.zeros_(self.out_proj.bias)
        bound = self.short_weight.shape[-1] ** -0.5  # nn.Conv1d's default for a depthwise kernel
        nn.init.uniform_(self.short_weight, -bound, bound)
        nn.init.zeros_(self.short_bias)
        self.filter.init_weights()


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=init_std)


class HyenaBlock(nn.Module):
    def __init__(self, layer_id: int, args: HyenaArgs):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mixer = HyenaMixer(args)
        self.mlp_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args.dim, args.mlp_ratio * args.dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, long_conv: LongConv | None = None) -> torch.Tensor:
        h = x + self.mixer(self.mixer_norm(x), long_conv=long_conv)  # a keyword: TP plans lay out positional inputs
        return h + self.mlp(self.mlp_norm(h))

    def init_weights(self) -> None:
        self.mixer_norm.reset_parameters()
        self.mlp_norm.reset_parameters()
        self.mixer.init_weights(self.init_std)
        self.mlp.init_weights(self.init_std)


class HyenaLM(nn.Module):
    def __init__(self, args: HyenaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): HyenaBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        """Token ids (B, L) -> logits (B, L, vocab), with FFT long convolutions."""
        if tokens_BL.shape[1] > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {tokens_BL.shape[1]} exceeds max_seq_len {self.args.max_seq_len}; "
                "build the model with a larger max_seq_len"
            )
        h = self.tok_embeddings(tokens_BL)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initializes every parameter in place (after `to_empty` from the meta device); there are no buffers."""
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5, a=-3 * self.args.dim**-0.5,
                              b=3 * self.args.dim**-0.5)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """HyenaLM keeps no non-persistent buffers: its filters are computed from parameters."""

    @torch.no_grad()
    def inference_filters(self, length: int | None = None) -> torch.Tensor:
        """Every long-convolution filter: (layers x order, dim, length), over max_seq_len unless a length is given."""
        L, N = length or self.args.max_seq_len, self.args.order
        if not 1 <= L <= self.args.max_seq_len:
            raise ValueError(f"length must be in [1, {self.args.max_seq_len}] (max_seq_len), got {L}")
        return torch.cat([b.mixer.filter(L).view(-1, N, L).transpose(0, 1) for b in self.layers.values()])


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    return n - model.tok_embeddings.weight.numel() if exclude_embedding else n


def flops_per_token(model: nn.Module, args: HyenaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding parameters plus the FFT long convolutions.

    Each long convolution does three real FFTs of size 2L per channel (~5 n log2 n flops each for n = 2L),
    forward and twice that backward.
    """
    n = 2 * seq_len
    fft_per_token = 3 * 3 * 5 * n * math.log2(n) / seq_len
    return 6 * num_params(model, exclude_embedding=True) + fft_per_token * args.order * args.dim * args.n_layers
