"""Activation checkpointing: which blocks are wrapped per mode, the same numerics as eager, less peak memory, the
op policy recomputing every second matmul of each block, and compiled op-level checkpointing keeps expert
parallel's all-to-alls out of the recompute (eager: in test_expert_parallel.py).

Tolerance: recomputation runs the same ops in the same order, so fp32 losses and gradients match eager to rtol 1e-6.
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titan.config.job_config import ActivationCheckpoint, Compile
from titan.distributed import apply_ac
from titan.distributed.compile import apply_compile
from titan.models.llama3.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, max_seq_len=64)
AC_MODES = {"full": ("full", "2"), "selective-op": ("selective", "op"), "selective-every-2": ("selective", "2")}


class PeakLiveBytes(TorchDispatchMode):
    """Memory probe: bytes of the tensor storages that ops allocate and that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            # Views and in-place results share a storage that is already counted.
            if key in self.sizes or storage.nbytes() == 0:
                continue
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key)
        return out


def tiny_model(ac: tuple[str, str] | None = None) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    if ac is not None:
        apply_ac(model, ActivationCheckpoint(mode=ac[0], selective_ac_option=ac[1]))
    return model


def loss_of(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def train_losses(model: Transformer, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model, torch.randint(0, ARGS.vocab_size, (4, 33), generator=gen))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def eager():
    return train_losses(tiny_model())


@pytest.mark.parametrize("mode", AC_MODES)
def test_activation_checkpointing_matches_eager(eager, mode):
    losses, params = train_losses(tiny_model(AC_MODES[mode]))
    assert losses == pytest.approx(eager[0], rel=1e-6)
    for got, want in zip(params, eager[1]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_activation_checkpointing_lowers_peak_memory():
    tokens = torch.randint(0, ARGS.vocab_size, (4, 65), generator=torch.Generator().manual_seed(2))
    peaks = {}
    for mode, ac in {"none": None, **AC_MODES}.items():
        model = tiny_model(ac)
        with PeakLiveBytes() as probe:
            loss_of(model, tokens).backward()
        peaks[mode] = probe.peak
    # Measured: none 7.0 MiB, full 3.1, op 4.0, every-2 4.5 (gradients included, same in all).
    assert peaks["full"] < 0.6 * peaks["none"], peaks
    assert peaks["full"] < peaks["selective-op"] < peaks["none"], peaks
    assert peaks["selective-every-2"] < 0.8 * peaks["none"], peaks


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func == torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


class SinChain(torch.nn.Module):
    """Three matmuls, each through sin, whose backward needs the matmul's output: a matmul the policy does not
    save runs again in backward."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.sin(x @ w)
        return x


def test_op_level_checkpointing_recomputes_every_second_matmul_of_each_block():
    """Two blocks of 3 matmuls: each block's 2nd is recomputed in backward, its 1st and 3rd saved, whatever the block
    before it did (a count shared by the blocks would recompute the 2nd block's 1st and 3rd)."""
    backward_calls = {}
    for mode in ("none", "op"):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleDict({"0": SinChain(), "1": SinChain()})
        apply_ac(model, ActivationCheckpoint(mode="selective" if mode == "op" else "none", selective_ac_option="op"))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        for block in model.layers.values():
            x = block(x)
        with MatmulCount() as count:
            x.sum().backward()
        backward_calls[mode] = count.calls
    assert backward_calls["op"] - backward_calls["none"] == 2


@pytest.mark.parametrize("mode, option, wrapped", [("none", "2", []), ("full", "2", [0, 1, 2, 3]),
                                                   ("selective", "2", [0, 2]), ("selective", "3", [0, 3]),
                                                   ("selective", "op", [0, 1, 2, 3])])
def test_each_mode_wraps_the_blocks_it_names(mode, option, wrapped):
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option))
    assert [i for i, block in enumerate(model.layers.values()) if isinstance(block, CheckpointWrapper)] == wrapped


def test_compiled_op_level_checkpointing_does_not_recompute_the_all_to_alls(world_of_one):
    """Compiled, AOT autograd's partitioner decides what backward recomputes, from the policy's tags: with the
    all-to-alls saved, the forward graph holds the three all-to-alls (counts, dispatch, combine) and the backward
    graph only the token exchanges' own two, as without checkpointing (recomputing them adds three: measured with
    the all-to-all left out of the policy). Expert parallel over the one rank."""
    from functorch.compile import make_boxed_func
    from torch import nn
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.device_mesh import init_device_mesh

    from titan.distributed.expert_parallel import apply_expert_parallel
    from titan.models.common.moe import MoE, MoEArgs

    calls = {"forward": 0, "backward": 0}

    def counting(graph_kind: str):
        def compiler(gm, _):
            calls[graph_kind] += sum(n.target == torch.ops._c10d_functional.all_to_all_single.default
                                     for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return compiler

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": MoE(16, MoEArgs(num_experts=8, top_k=2, hidden_dim=8, route_norm=True))})
    model.layers["0"].init_weights(0.1)
    apply_expert_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"))
    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"))
    apply_compile(model, Compile(enable=True, components=["model"], backend=backend))
    model.layers["0"](torch.randn(24, 16, requires_grad=True)).sum().backward()
    assert calls == {"forward": 3, "backward": 2}
