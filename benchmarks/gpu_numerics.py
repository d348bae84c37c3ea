"""Numerics of titan's device code on the device named by TITAN_TEST_DEVICE (default cpu), as pytest tests.

`benchmarks/gpu_check.sh --part tests` runs them on CUDA, where the float8 linears take the real `_scaled_mm`
and compile generates Triton kernels; its dry run runs them on the CPU so that they keep working. Not collected
by the suite (the file name does not start with test_): `pytest benchmarks/gpu_numerics.py` runs it.
lcsm's exactness on the device is in the lcsm part (every record's max_abs_err against the FFT reference).

Tolerances as in tests/titan/quantization/test_float8.py: float8 (e4m3) operands give a relative error of about
0.037 against the bf16 matmul; the hardware path and the emulation compute the same rounded products, so they
agree to bf16 rounding of the output. A compiled bf16 block may fuse and reorder: within 2e-2 of eager.
"""

import os

import pytest
import torch
from torch import nn

from titan.config.job_config import Compile
from titan.distributed.compile import apply_compile
from titan.models.llama3.model import ModelArgs, Transformer
from titan.quantization.float8 import CPU_ROWWISE_MISSING, Float8Linear, cpu_scaled_mm_supported, scaled_mm_supported

DEVICE = torch.device(os.environ.get("TITAN_TEST_DEVICE", "cpu"))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_the_device_is_the_one_asked_for():
    assert torch.empty(1, device=DEVICE).device.type == DEVICE.type


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_hardware_path_matches_emulation_and_bf16(recipe):
    if DEVICE.type == "cuda" and not scaled_mm_supported(DEVICE, recipe):
        pytest.skip(f"{torch.cuda.get_device_name(DEVICE)} has no float8 _scaled_mm for {recipe}")
    if DEVICE.type == "cpu" and not cpu_scaled_mm_supported(recipe):
        pytest.skip(CPU_ROWWISE_MISSING)
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=False, device=DEVICE)
    x = torch.randn(8, 64, 256, device=DEVICE)
    outputs = {}
    for name, layer in [("scaled_mm", Float8Linear.from_linear(linear, recipe, True)),
                        ("emulated", Float8Linear.from_linear(linear, recipe, False)), ("bf16", linear)]:
        xi = x.clone().requires_grad_()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            y = layer(xi)
        y.float().square().sum().backward()
        outputs[name] = (y.detach(), xi.grad, linear.weight.grad.clone())
        linear.weight.grad = None
    for got, want in zip(outputs["scaled_mm"], outputs["emulated"]):
        assert rel_err(got, want) < 1e-2
    y8, dx8, dw8 = outputs["scaled_mm"]
    y, dx, dw = outputs["bf16"]
    assert rel_err(y8, y) < 0.06 and rel_err(dx8, dx) < 0.10 and rel_err(dw8, dw) < 0.10


def test_compiled_blocks_match_eager_forward_and_gradients():
    torch.manual_seed(0)
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=64)
    eager = Transformer(args).to(DEVICE)
    eager.init_weights(buffer_device=DEVICE)
    compiled = Transformer(args).to(DEVICE)
    compiled.load_state_dict(eager.state_dict())
    compiled.init_buffers(buffer_device=DEVICE)
    # On CUDA inductor generates Triton kernels; on a CPU (the dry run) graph capture alone keeps the test quick.
    apply_compile(compiled, Compile(enable=True, backend="inductor" if DEVICE.type == "cuda" else "aot_eager"))
    tokens = torch.randint(0, args.vocab_size, (2, 64), device=DEVICE)
    results = []
    for model in (eager, compiled):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n.replace("._orig_mod", ""): p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert rel_err(got, want) < 2e-2
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        assert rel_err(got_grads[name], want_grads[name]) < 5e-2, name
