"""One generated token through a HyenaDNA model outside its long convolutions, with the modules' own tensor ops."""

from __future__ import annotations

import torch

from lcsm.inference.decode import DecodeState
from lcsm.inference.engines import OnlineConv
from lcsm.model.hyenadna import DNABlock, HyenaDNA


class DNABlockStep:
    """A DNABlock's one-token step: its short filter runs on a ring of in_proj outputs (zeros before position 0)."""

    def __init__(self, block: DNABlock, batch: int):
        mixer = block.mixer
        self.block, self.order = block, mixer.order - 1
        """order: the engine slots the block uses (one per long convolution)."""
        self.K = mixer.short_filter.kernel_size[0]
        self.ring = mixer.in_proj.weight.new_zeros(batch, self.K, mixer.in_proj.out_features)
        """in_proj outputs of positions t - K + 1 .. t during step t, oldest first."""
        self.kernel_KC = mixer.short_filter.weight[:, 0].T.contiguous()  # slot j of the ring takes tap j

    def prefill(self, block: DNABlock, x_BPD: torch.Tensor, engine: OnlineConv, first_slot: int) -> torch.Tensor:
        P, K = x_BPD.shape[1], self.K
        last = block.mixer.in_proj(block.norm1(x_BPD[:, max(P - K, 0) :]))
        self.ring[:, K - last.shape[1] :] = last
        return block(x_BPD, long_conv=lambda y, o: engine.prefill(y, slot=first_slot + o))

    def step(self, x_BD: torch.Tensor, engine: OnlineConv, first_slot: int) -> torch.Tensor:
        block, mixer = self.block, self.block.mixer
        self.ring = torch.roll(self.ring, -1, dims=1)
        self.ring[:, -1] = mixer.in_proj(block.norm1(x_BD))
        u = (self.ring * self.kernel_KC).sum(1) + mixer.short_filter.bias
        *gates, v = u.split(mixer.dim, dim=1)
        for o in range(self.order):
            v = engine.step(v * gates[self.order - o], first_slot + o)
        h = x_BD + mixer.out_proj(v * gates[0])
        return h + block.mlp(block.norm2(h))


class DNADecodeState(DecodeState):
    """Decoding a HyenaDNA model: its blocks' modules step by step, the long convolutions through the engine."""

    def __init__(self, model: HyenaDNA, engine: OnlineConv, batch: int):
        super().__init__(model, engine, [DNABlockStep(block, batch) for block in model.layers.values()])

    @torch.inference_mode()
    def step(self, token_B: torch.Tensor) -> torch.Tensor:
        if self.pos >= self.engine.L:
            raise ValueError(f"all {self.engine.L} positions are used; build the state with a longer length")
        x = self.model.tok_embeddings(token_B)
        for i, block in enumerate(self.blocks):
            x = block.step(x, self.engine, i * block.order)
        self.pos += 1
        return self.model.output(self.model.norm(x))
