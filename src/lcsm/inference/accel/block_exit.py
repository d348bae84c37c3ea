"""One block boundary of a Hyena LM during decoding, as tensor math and compiled ahead of time (accel.decode).

block_exit is everything between one block's last long convolution and the next block's first: the last gate,
out_proj, the MLP, the next block's RMSNorm, in_proj and short conv. AOTInductor compiles it once per machine and
shape into one C++ call; steps.c has the same arithmetic in C.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import torch
from torch import nn

from lcsm.inference.accel import autotune
from lcsm.inference.decode import rms_scale
from titan.tools.cli import UserError


def block_exit(x_BD, z_BD, gate_BD, ring_BKGD, out_w_DD, out_b_D, w1_DH, w2_HD, in_w_DGD, in_b_GD, conv_w_KGD,
               conv_b_GD, D_eps: float):
    """A block's output from its input x and its last long convolution z, then the next block's ring of in_proj
    outputs (B, K, G, D) and its short conv's output u (B, G, D): returns (out_BD, ring_BKGD, u_BGD)."""
    h = torch.addmm(x_BD, gate_BD * z_BD, out_w_DD).add_(out_b_D)
    # gelu(a) @ w2 = (a' + a' erf(a')) @ (w2 / sqrt 2) with a' = a / sqrt 2, folded into w1 and w2.
    a = torch.mm(h, w1_DH).mul_(rms_scale(h, D_eps))
    out = torch.addmm(h, torch.addcmul(a, a, torch.erf(a)), w2_HD)
    projected = torch.addmm(in_b_GD.flatten(), out * rms_scale(out, D_eps), in_w_DGD.flatten(1))
    B, _, _, D = ring_BKGD.shape
    ring = torch.cat([ring_BKGD[:, 1:], projected.view(B, 1, -1, D)], 1)
    return out, ring, torch.sum(ring * conv_w_KGD, 1).add_(conv_b_GD)


class BlockExit(nn.Module):
    """block_exit as a module, for torch.export (D_eps is a constant of the compiled code)."""

    def __init__(self, D_eps: float):
        super().__init__()
        self.D_eps = D_eps

    def forward(self, *tensors):
        return block_exit(*tensors, D_eps=self.D_eps)


class CompileError(UserError):
    """The compiled decode step could not be built (most often: no C++ compiler); the CLIs print it as one line."""


def compiled_block_exit(example: tuple[torch.Tensor, ...], D_eps: float):
    """block_exit compiled by AOTInductor for the example's shapes (G, the in_proj groups, left free): built once
    per machine, torch version, dtype and shape (tens of seconds), then loaded from $LCSM_CACHE_DIR/decode.
    Returns a function of the same tensors, returning a list of the three outputs."""
    if not all(t.is_contiguous() for t in example):
        raise ValueError("the example tensors must be contiguous: the compiled code assumes their strides")
    shapes = " ".join("x".join(map(str, t.shape)) for t in example[:8])
    key = f"{autotune.machine(example[0].device)} | {example[0].dtype} | {shapes} | eps {D_eps!r}"
    path = autotune.cache_file().parent / "decode" / f"block_exit-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt2"
    if not path.is_file():
        print(f"lcsm: compiling the decode step ({shapes.split()[0]} {str(example[0].dtype)[6:]}, "
              f"{example[0].device.type}) once for this machine into {path} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")  # aoti wants the suffix
        G = torch.export.Dim("G", min=2)
        dynamic = ((None,) * 3 + ({2: G},) + (None,) * 4 + ({1: G}, {0: G}, {1: G}, {0: G}),)
        try:
            program = torch.export.export(BlockExit(D_eps), example, dynamic_shapes=dynamic)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
            tmp.replace(path)  # atomic: a concurrent process loads the old package or the new one
        except Exception as e:
            tmp.unlink(missing_ok=True)
            raise CompileError(f"compiling the decode step failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                               "AOTInductor needs a C++ compiler on the CPU. Decode another way instead "
                               "(decode='eager' or 'native', or --decode eager|native)") from e
        print(f"lcsm: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    # The loader's run() takes the flat tensor list; the package's __call__ adds pytree (un)flattening per call.
    run = torch._inductor.aoti_load_package(str(path)).loader.run

    def compiled(x, z, gate, *rest):
        # The compiled code assumes the example's (contiguous) strides and does not check them; at B > 1 an
        # engine's output and the gate (a view of u) are strided.
        return run([x, z.contiguous(), gate.contiguous(), *rest])

    return compiled
