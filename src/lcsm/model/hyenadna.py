"""HyenaDNA (Nguyen et al. 2023): the Hyena LM of the public HyenaDNA checkpoints, as their model code computes it.

What differs from lcsm.model.hyena.HyenaLM:
- the mixer: in_proj's output channels are order-major [p, d]: the gates x_0 .. x_{N-1}, then the value v; the
  recurrence v <- h_o * (v x_{N-1-o}) + D_o (v x_{N-1-o}) for o = 0 .. N-2 (N - 1 long convolutions), then
  out_proj(v x_0);
- the implicit filter: positional features z (t, then cos and -sin bands) stored per position up to l_max (they
  are trained in the reference, so they are weights, and the filter depends on l_max through them and through t),
  an MLP whose sine activations share one frequency vector, a final projection without bias, then the modulation
  h * (exp(-t |delta_c|) + shift); the skip term D is separate from the filter;
- LayerNorm with bias, an MLP with biases and tanh-approximated gelu; the head is a bias-free linear over the
  vocabulary padded to a multiple of pad_vocab_size_multiple; dropout applies in training only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm.model.fftconv import fft_causal_conv

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[BOS]", "[MASK]", "[PAD]", "[RESERVED]", "[UNK]")
DNA_CHARACTERS = ("A", "C", "G", "T", "N")


@dataclass
class HyenaDNAArgs:
    """HyenaDNA's model arguments (its config.json's names, `layer.*` flattened)."""

    d_model: int = 128
    n_layer: int = 2
    d_inner: int = 512
    vocab_size: int = 12
    pad_vocab_size_multiple: int = 8
    l_max: int = 1026
    """Filter length: the positions the filter's features are stored for."""
    order: int = 2
    """Projections per mixer are order + 1 (the gates and the value); long convolutions order - 1."""
    filter_order: int = 64
    """Width of the implicit filter's MLP."""
    emb_dim: int = 5
    short_filter_order: int = 3
    num_inner_mlps: int = 2
    w: float = 1.0
    """Initial frequency of the filter MLP's sine activations."""
    modulate: bool = True
    shift: float = 0.05
    norm_eps: float = 1e-5
    """eps of the blocks' LayerNorms."""
    final_norm_eps: float = 1e-5

    @property
    def max_seq_len(self) -> int:
        return self.l_max

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return -(-self.vocab_size // m) * m


HYENADNA_CONFIGS = {
    f"hyenadna-{name}": HyenaDNAArgs(d_model=d, n_layer=n, d_inner=4 * d, l_max=l_max, emb_dim=5, filter_order=64,
                                     w=10.0)
    for name, d, n, l_max in (("tiny-1k", 128, 2, 1026), ("small-32k", 256, 4, 32770),
                              ("medium-160k", 256, 8, 160002), ("medium-450k", 256, 8, 450002),
                              ("large-1m", 256, 8, 1_000_002))
}
"""The published checkpoints' configurations (config.json of LongSafari/hyenadna-<name>-seqlen)."""


def positional_features(l_max: int, emb_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z (l_max, emb_dim): normalized time t, then cos(f_b w_k) and -sin(f_b w_k) for (emb_dim - 1) / 2 bands f_b
    from 1e-4 to bands - 1, with w_k = 2 pi k / l_max; and t (l_max,), k / (l_max - 1)."""
    t = torch.linspace(0, 1, l_max)
    bands = (emb_dim - 1) // 2
    w = 2 * math.pi * torch.linspace(0, l_max - 1, l_max) / l_max
    angle = w[:, None] * torch.linspace(1e-4, bands - 1, bands)
    return torch.cat([t[:, None], torch.cos(angle), -torch.sin(angle)], dim=-1), t


class DNAFilter(nn.Module):
    """h[c, k] = proj(MLP(z_k))[c] * (exp(-t_k |deltas_c|) + shift) for `channels` channels, plus the skip D."""

    def __init__(self, channels: int, args: HyenaDNAArgs):
        super().__init__()
        if args.emb_dim < 3 or args.emb_dim % 2 == 0:
            raise ValueError(f"emb_dim must be odd and >= 3 (time, cos and sin bands), got {args.emb_dim}")
        self.modulate, self.shift, self.w = args.modulate, args.shift, args.w
        z, t = positional_features(args.l_max, args.emb_dim)
        self.z = nn.Parameter(z)
        self.register_buffer("t", t)
        H = args.filter_order
        self.mlp = nn.ModuleList([nn.Linear(args.emb_dim, H)] + [nn.Linear(H, H) for _ in range(args.num_inner_mlps)])
        self.freq = nn.Parameter(torch.full((H,), float(args.w)))
        """One frequency vector for every sine activation (the reference shares one activation module)."""
        self.proj = nn.Linear(H, channels, bias=False)
        self.register_buffer("deltas", self.initial_deltas(channels))
        self.D = nn.Parameter(torch.randn(channels))

    @staticmethod
    def initial_deltas(channels: int) -> torch.Tensor:
        """Decay rates from ln(0.01) / 1.5 to ln(0.01) / 0.3: |h| falls to 1 % after 150 % to 30 % of l_max."""
        return torch.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, channels)

    def forward(self, L: int) -> torch.Tensor:
        """The filters for lags 0 .. L-1: (channels, L), without D."""
        h = self.z[:L]
        for linear in self.mlp:
            h = torch.sin(self.freq * linear(h))
        h_LC = self.proj(h)
        if self.modulate:
            h_LC = h_LC * (torch.exp(-self.t[:L, None] * self.deltas.abs()) + self.shift)
        return h_LC.T


class DNAMixer(nn.Module):
    def __init__(self, args: HyenaDNAArgs):
        super().__init__()
        if args.order < 2:
            raise ValueError(f"order must be >= 2 (one long convolution per order above 1), got {args.order}")
        D, N = args.d_model, args.order
        self.order, self.dim = N, D
        self.in_proj = nn.Linear(D, (N + 1) * D)
        self.short_filter = nn.Conv1d((N + 1) * D, (N + 1) * D, args.short_filter_order, groups=(N + 1) * D,
                                      padding=args.short_filter_order - 1)
        self.filter = DNAFilter((N - 1) * D, args)
        self.out_proj = nn.Linear(D, D)

    def forward(self, x_BLD: torch.Tensor, long_conv=None) -> torch.Tensor:
        """`long_conv(y_BDL, o)` replaces the o-th FFT convolution, skip term included (an online engine's prefill)."""
        L = x_BLD.shape[1]
        u = self.short_filter(self.in_proj(x_BLD).transpose(1, 2))[..., :L]
        *gates, v = u.split(self.dim, dim=1)
        if long_conv is None:
            h = self.filter(L).view(self.order - 1, self.dim, L)
            D = self.filter.D.view(self.order - 1, self.dim, 1)

            def long_conv(y: torch.Tensor, o: int) -> torch.Tensor:
                return fft_causal_conv(y, h[o]) + y * D[o]

        for o in range(self.order - 1):
            v = long_conv(v * gates[self.order - 1 - o], o)
        return self.out_proj((v * gates[0]).transpose(1, 2))

    def inference_filters(self, L: int) -> torch.Tensor:
        """(order - 1, d_model, L): each long convolution's filter with D folded into lag 0."""
        h = self.filter(L).view(self.order - 1, self.dim, L)
        return torch.cat([h[..., :1] + self.filter.D.view(self.order - 1, self.dim, 1), h[..., 1:]], dim=-1)


class DNAMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DNABlock(nn.Module):
    """Pre-norm: x + mixer(norm1(x)), then h + mlp(norm2(h))."""

    def __init__(self, args: HyenaDNAArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.mixer = DNAMixer(args)
        self.norm2 = nn.LayerNorm(args.d_model, eps=args.norm_eps)
        self.mlp = DNAMLP(args.d_model, args.d_inner)

    def forward(self, x: torch.Tensor, long_conv=None) -> torch.Tensor:
        h = x + self.mixer(self.norm1(x), long_conv=long_conv)
        return h + self.mlp(self.norm2(h))


class HyenaDNA(nn.Module):
    """tokens (B, T) -> logits (B, T, padded vocabulary)."""

    def __init__(self, args: HyenaDNAArgs):
        super().__init__()
        self.args = args
        V = args.padded_vocab_size
        self.tok_embeddings = nn.Embedding(V, args.d_model)
        self.layers = nn.ModuleDict({str(i): DNABlock(args) for i in range(args.n_layer)})
        self.norm = nn.LayerNorm(args.d_model, eps=args.final_norm_eps)
        self.output = nn.Linear(args.d_model, V, bias=False)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        if tokens_BT.shape[1] > self.args.l_max:
            raise ValueError(f"sequence length {tokens_BT.shape[1]} exceeds the filters' l_max {self.args.l_max}")
        h = self.tok_embeddings(tokens_BT)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """The reference's initialization: N(0, 0.02) linears and embedding with zero biases, the residual outputs
        (out_proj, fc2) at 0.02 / sqrt(2 n_layer); the head shares the embedding's values."""
        if seed is not None:
            torch.manual_seed(seed)
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scaled = name.endswith(("out_proj", "fc2"))
                nn.init.normal_(module.weight, std=std / math.sqrt(2 * self.args.n_layer) if scaled else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.output.weight.copy_(self.tok_embeddings.weight)

    @torch.no_grad()
    def inference_filters(self, length: int | None = None) -> torch.Tensor:
        """Every long-convolution filter, D folded into lag 0: (layers x (order - 1), d_model, length), over l_max
        positions unless a length is given."""
        L = length or self.args.l_max
        if not 1 <= L <= self.args.l_max:
            raise ValueError(f"length must be in [1, {self.args.l_max}] (l_max), got {L}")
        return torch.cat([block.mixer.inference_filters(L) for block in self.layers.values()])


class CharacterTokenizer:
    """HyenaDNA's character vocabulary: the special tokens at ids 0 .. 6, then one id per character from 7; any
    other character is [UNK]. encode adds no special tokens."""

    def __init__(self, characters: tuple[str, ...] = DNA_CHARACTERS):
        self.vocab = {**{s: i for i, s in enumerate(SPECIAL_TOKENS)},
                      **{c: len(SPECIAL_TOKENS) + i for i, c in enumerate(characters)}}
        self.id_to_token = {i: s for s, i in self.vocab.items()}
        self.unk_id = self.vocab["[UNK]"]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(c, self.unk_id) for c in text]

    def decode(self, ids: list[int]) -> str:
        """Ids beyond the vocabulary (the head's padding rows) read as [PAD]."""
        return "".join(self.id_to_token.get(i, "[PAD]") for i in ids)
