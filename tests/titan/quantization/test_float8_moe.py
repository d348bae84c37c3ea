"""Float8 training of the MoE decoders (Qwen3-MoE, DeepSeek-V3): every dense nn.Linear converts (attention, dense
and shared-expert SwiGLUs), the router gate stays high precision (routing picks top-k from its logits) and so do
the grouped experts (parameters, no nn.Linear: no float8 grouped GEMM on a CPU), with titan's and torchao's
conversion alike; a float8 run's losses stay close to bf16's, on one process and with expert parallel and float8
all-gather over FSDP."""

import dataclasses

import pytest
import torch
from torch import nn

from tests.titan.conftest import TINY, losses, run_train
from titan.config.job_config import Float8
from titan.models.common.moe import GroupedExperts, MoE
from titan.models.deepseek_v3 import Transformer, deepseek_v3_flavors
from titan.models.qwen3_moe import Qwen3MoeDecoder, qwen3_moe_flavors
from titan.quantization.float8 import apply_float8

# 16 experts: a gate whose dims the float8 kernels take, so only the router rule keeps it high precision.
MODELS = {"qwen3_moe": (Qwen3MoeDecoder, qwen3_moe_flavors, {"num_experts": 16}),
          "deepseek_v3": (Transformer, deepseek_v3_flavors, {"n_routed_experts": 16})}


@pytest.mark.parametrize("backend", ["titan", "torchao"])
@pytest.mark.parametrize("family", MODELS)
def test_dense_linears_convert_but_not_the_router_gate_or_the_grouped_experts(family, backend):
    if backend == "torchao":
        pytest.importorskip("torchao")
    build, flavors, experts = MODELS[family]
    with torch.device("meta"):
        model = build(dataclasses.replace(flavors["debug"], n_layers=2, **experts))
    linears = {fqn for fqn, m in model.named_modules() if type(m) is nn.Linear}
    swapped = apply_float8(model, Float8(enable=True, backend=backend), torch.device("cpu"))
    converted = {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear}
    gates = {fqn for fqn in linears if fqn.endswith("router.gate")}
    assert gates and converted == linears - gates - {"output"} and swapped == len(converted)
    if family == "deepseek_v3":  # its shared experts are a dense SwiGLU
        assert "layers.1.moe.shared_experts.w1" in converted
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers and all(type(m.router.gate) is nn.Linear for m in layers)
    assert all(type(m.experts) is GroupedExperts for m in layers)
    assert all(type(p) is nn.Parameter for m in layers for p in m.experts.parameters())


# bf16 compute, a learning rate high enough that the loss moves, 6 steps.
CURVE = [*TINY, "--training.mixed_precision_param", "bfloat16", "--training.steps", "6", "--optimizer.lr", "3e-3"]


@pytest.mark.parametrize("family, nproc, layout", [
    ("qwen3_moe", 1, []),
    ("deepseek_v3", 2, ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
                        "--float8.enable_fsdp_float8_all_gather"]),
], ids=["qwen3_moe-1proc", "deepseek_v3-ep2-fsdp-float8-all-gather"])
def test_float8_loss_curve_stays_close_to_bf16(tmp_path, family, nproc, layout):
    args = [*CURVE, "--model.name", family]
    run_train([*args, "--job.dump_folder", str(tmp_path / "bf16")])
    proc = run_train([*args, "--float8.enable", *layout, "--job.dump_folder", str(tmp_path / "float8")], nproc=nproc)
    assert "router.gate" in proc.stderr + proc.stdout  # named among the layers kept in high precision
    got, want = losses(tmp_path / "float8"), losses(tmp_path / "bf16")
    assert len(got) == len(want) == 6
    assert got == pytest.approx(want, abs=0.02)
