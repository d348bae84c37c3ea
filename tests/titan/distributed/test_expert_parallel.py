"""Expert parallel over 2 gloo ranks gives the one-process MoE layer's outputs and gradients (fp32, 1e-5; the
loss is the mean over ranks of each rank's own, as under data parallel), for Qwen3-MoE and DeepSeek-V3 routing, with
the grouped GEMM and the per-expert loop; comm_stats counts its all-to-all bytes, and op-level activation
checkpointing saves its all-to-alls instead of recomputing them. One 2-rank job (this module's __main__) runs every
case; the tests read what it saved."""

import copy
import os
import sys

import pytest
import torch

from tests.launch import run_module
from titan.models.common.moe import MoE, MoEArgs
from titan.models.common.moe_load import expert_load_step

DIM, HIDDEN, TOKENS = 16, 8, 24
ARGS = {
    "qwen3": MoEArgs(num_experts=8, top_k=2, hidden_dim=HIDDEN, route_norm=True),
    # An expert that never gets a token (bias -100): one rank sends and receives nothing for it.
    "deepseek_v3": MoEArgs(num_experts=8, top_k=3, hidden_dim=HIDDEN, num_shared_experts=1, score_func="sigmoid",
                           route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2),
}


def _layer(name: str, grouped: bool) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, copy.deepcopy(ARGS[name]))
    moe.init_weights(0.1)
    with torch.no_grad():
        moe.router.gate.weight.mul_(10)  # sharp routing, so that the loads are uneven
        if name == "deepseek_v3":
            moe.router.expert_bias[6] = -100.0
    moe.experts.use_grouped_mm = grouped
    return moe


def _case(name: str, grouped: bool) -> dict:
    """On one rank of 2: this rank's outputs and the gradients of the loss summed over both ranks, EP 2 and the
    one-process layer on both ranks' tokens; plus the balance statistics and the all-to-all calls and bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titan.distributed.comm_stats import CommStats
    from titan.distributed.expert_parallel import apply_expert_parallel

    rank = dist.get_rank()
    x_RTD = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    g_RTD = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(2))
    reference = _layer(name, grouped)
    # The loss: each rank's own sum, averaged over the ranks as data parallel averages gradients.
    x = x_RTD.clone().requires_grad_()
    want = reference(x)
    ((want * g_RTD).sum() / 2).backward()
    want_stats = expert_load_step(reference)

    moe = _layer(name, grouped)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    assert apply_expert_parallel(moe, mesh) == 1
    xr = x_RTD[rank].clone().requires_grad_()
    with CommStats() as stats:
        got = moe(xr)
        (got * g_RTD[rank]).sum().backward()
    grads = {}
    for pname, p in moe.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not hasattr(p, "full_tensor"):  # replicated: data parallel averages the ranks' gradients
            dist.all_reduce(grad)
            grad /= 2
        grads[pname] = (grad, dict(reference.named_parameters())[pname].grad)
    # Bytes: the larger of input and output per call. The counts (8 int64), then four token exchanges, each with
    # this rank's TOKENS * k copies on one side and the copies its 4 experts receive on the other.
    _, experts_NK, _ = reference.router(x_RTD.view(-1, DIM))
    received = int(torch.bincount(experts_NK.flatten(), minlength=8).view(2, 4)[rank].sum())
    rows = max(TOKENS * moe.args.top_k, received)
    a2a = [v for (kind, _), v in stats.table().items() if kind == "all_to_all"]
    return {"out": (got.detach(), want[rank].detach()), "x_grad": (xr.grad / 2, x.grad[rank]), "grads": grads,
            "local_shape": tuple(moe.experts.w1.to_local().shape),
            "stats": ({k: v.item() for k, v in expert_load_step(moe, group=mesh.get_group()).items()},
                      {k: v.item() for k, v in want_stats.items()}),
            "all_to_all": (a2a, 8 * 8 + 4 * rows * DIM * 4), "received": received}


def _op_checkpointed(name: str) -> dict:
    """On one rank of 2: the EP 2 layer as a model's block without activation checkpointing and under op-level
    selective checkpointing; per mode the all-to-all calls of one forward and backward, the output and gradients."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from titan.config.job_config import ActivationCheckpoint
    from titan.distributed import apply_ac
    from titan.distributed.comm_stats import CommStats
    from titan.distributed.expert_parallel import apply_expert_parallel

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    x_TD = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(1))[rank]
    g_TD = torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(2))[rank]
    results = {}
    for mode in ("none", "selective"):
        model = nn.Module()
        model.layers = nn.ModuleDict({"0": _layer(name, grouped=True)})
        apply_expert_parallel(model, mesh)
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option="op"))
        x = x_TD.clone().requires_grad_()
        with CommStats() as stats:
            out = model.layers["0"](x)
            (out * g_TD).sum().backward()
        (a2a,) = [v["calls"] for (kind, _), v in stats.table().items() if kind == "all_to_all"]
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        results[mode] = {"all_to_all_calls": a2a, "tensors": [out.detach(), x.grad, *grads]}
    return results


CASES = [(name, grouped) for name in ARGS for grouped in (True, False)]


@pytest.fixture(scope="module")
def ranks(module_tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_module("tests.titan.distributed.test_expert_parallel", [str(module_tmp_path)], env, nproc=2,
                      timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(module_tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", [f"{n}-{'grouped_mm' if g else 'loop'}" for n, g in CASES])
def test_ep2_gives_the_one_process_outputs_and_gradients(ranks, case):
    for rank in ranks:
        result = rank[case]
        assert result["local_shape"] == (4, HIDDEN, DIM)  # half of the 8 experts on each rank
        torch.testing.assert_close(*result["out"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["x_grad"], rtol=1e-5, atol=1e-6)
        assert set(result["grads"]) == {n for n, _ in MoE(DIM, ARGS[case.split("-")[0]]).named_parameters()}
        for pname, (got, want) in result["grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=pname)
        # The balance statistics sum the ranks' counts: those of the one-process layer.
        assert result["stats"][0] == result["stats"][1]


def test_comm_stats_counts_the_dispatch_and_combine_all_to_alls(ranks):
    for rank in ranks:
        (counted,), expected_bytes = rank["deepseek_v3-grouped_mm"]["all_to_all"]
        # Forward: the counts, the tokens out, the results back; backward: the two token exchanges again.
        assert counted == {"calls": 5, "bytes": expected_bytes}
    # The split is uneven: the ranks' experts receive different numbers of token copies.
    assert ranks[0]["deepseek_v3-grouped_mm"]["received"] != ranks[1]["deepseek_v3-grouped_mm"]["received"]


def test_op_level_checkpointing_saves_the_all_to_alls_instead_of_communicating_again(ranks):
    """The recompute in backward takes the counts, dispatch and combine from what the forward saved: the calls of
    the run without checkpointing (forward 3, backward 2 for the token exchanges), and the same result."""
    for rank in ranks:
        for name in ARGS:
            plain, checkpointed = rank[f"{name}-op-sac"]["none"], rank[f"{name}-op-sac"]["selective"]
            assert checkpointed["all_to_all_calls"] == plain["all_to_all_calls"] == 5
            for got, want in zip(checkpointed["tensors"], plain["tensors"], strict=True):
                assert torch.equal(got, want)


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {f"{n}-{'grouped_mm' if g else 'loop'}": _case(n, g) for n, g in CASES}
    results |= {f"{n}-op-sac": _op_checkpointed(n) for n in ARGS}
    torch.save(results, f"{sys.argv[1]}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
