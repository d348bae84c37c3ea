"""Float8 training: quantization error bounds, emulation == torch._scaled_mm, the module swap, loss curves.

Stated tolerances. e4m3 keeps 3 mantissa bits: every quantized value is within 2^-4 (relative) of its input,
e5m2 within 2^-3. A matmul of two e4m3-quantized random operands then has a relative (Frobenius) error of
about 0.037 (two independent 2^-4-bounded roundings); we allow 0.06, and 0.10 where an e5m2 gradient takes
part. A short training run's loss stays within 0.02 (absolute, ~0.25 %) of the bf16 run at every step, and a
run with float8 all-gather within 0.02 of the float8 run without it (it quantizes the fp32 shard directly
instead of its bf16 copy, so the two differ by float8 rounding, ~1e-3 here).
"""

import json
import os
import sys

import pytest
import torch
from torch import nn

from tests.launch import run_module
from tests.titan.conftest import losses, run_train
from titan.config.job_config import Float8
from titan.models.llama3.flavors import llama3_flavors
from titan.models.llama3.model import Transformer
from titan.quantization.float8 import (
    CPU_ROWWISE_MISSING,
    E4M3,
    E5M2,
    Float8AllGatherWeight,
    Float8Linear,
    apply_float8,
    cpu_scaled_mm_supported,
    enable_float8_all_gather,
    float8_mm,
    precompute_float8_scales,
    quantize,
)

RECIPES = ["tensorwise", "rowwise"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("dtype,bound", [(E4M3, 2**-4), (E5M2, 2**-3)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [None, 1], ids=["tensorwise", "rowwise"])
def test_quantization_error_is_within_half_an_ulp(dtype, bound, dim):
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]
    x8, inv_scale = quantize(x, dtype, dim)
    assert x8.dtype == dtype
    # Power-of-two scales: dequantizing is exact in bf16.
    assert torch.equal(inv_scale, torch.exp2(torch.log2(inv_scale).round()))
    # The absolute max lands in the top binade of the format (nothing overflows, at most 1 bit of range unused).
    top = (x8.float().abs().amax() if dim is None else x8.float().abs().amax(dim=dim)) / torch.finfo(dtype).max
    assert ((top >= 0.5) & (top <= 1.0)).all()
    deq = x8.float() * inv_scale
    normal = x.abs() >= torch.finfo(dtype).tiny * inv_scale  # subnormals have fewer mantissa bits
    assert ((deq - x).abs() <= bound * x.abs())[normal].all()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulation_matches_scaled_mm_and_is_close_to_the_matmul(rowwise, dtype):
    if not cpu_scaled_mm_supported("rowwise" if rowwise else "tensorwise"):
        pytest.skip(CPU_ROWWISE_MISSING)
    torch.manual_seed(0)
    a, b = torch.randn(64, 128, dtype=dtype), torch.randn(128, 96, dtype=dtype)
    emulated = float8_mm(a, b, E4M3, E4M3, rowwise, use_scaled_mm=False)
    hardware = float8_mm(a, b, E4M3, E4M3, rowwise, use_scaled_mm=True)
    assert emulated.dtype == hardware.dtype == dtype
    torch.testing.assert_close(emulated, hardware)
    assert rel_err(emulated, a.float() @ b.float()) < 0.06
    grad_like = float8_mm(a, b, E5M2, E4M3, rowwise, use_scaled_mm=False)
    assert rel_err(grad_like, a.float() @ b.float()) < 0.10


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_output_and_gradients_are_close_to_linear(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True)
    fp8 = Float8Linear.from_linear(linear, recipe, use_scaled_mm=False)
    x = torch.randn(4, 16, 128, requires_grad=True)
    grad_out = torch.randn(4, 16, 96)
    grads = []
    for module in (fp8, linear):
        y = module(x)
        y.backward(grad_out)
        grads.append((y.detach(), x.grad, linear.weight.grad, linear.bias.grad))
        x.grad = linear.weight.grad = linear.bias.grad = None
    (y8, gx8, gw8, gb8), (y, gx, gw, gb) = grads
    assert rel_err(y8, y) < 0.06
    assert rel_err(gx8, gx) < 0.10 and rel_err(gw8, gw) < 0.10
    torch.testing.assert_close(gb8, gb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8(x).dtype == torch.bfloat16


@pytest.mark.parametrize("recipe", RECIPES)
def test_scaled_mm_path_of_the_linear_matches_emulation(recipe):
    """Runs the _scaled_mm layouts of forward and both backward matmuls on the CPU (where it exists, slowly)."""
    if not cpu_scaled_mm_supported(recipe):
        pytest.skip(CPU_ROWWISE_MISSING)
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=False)
    x = torch.randn(4, 16, 128, requires_grad=True)
    results = []
    for use_scaled_mm in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = Float8Linear.from_linear(linear, recipe, use_scaled_mm)(x)
        y.float().square().sum().backward()
        results.append((y, x.grad, linear.weight.grad))
        x.grad = linear.weight.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


def test_apply_float8_swaps_block_linears_but_not_the_output_or_odd_dims():
    args = llama3_flavors["debug"]
    with torch.device("meta"):
        model = Transformer(args)
        model.layers["0"].feed_forward.w2 = nn.Linear(200, args.dim, bias=False)
    keys = set(model.state_dict())
    swapped = apply_float8(model, Float8(enable=True, recipe="rowwise"))
    assert swapped == 7 * args.n_layers - 1
    assert type(model.output) is nn.Linear and type(model.layers["0"].feed_forward.w2) is nn.Linear
    assert isinstance(model.layers["1"].attention.wq, Float8Linear)
    assert model.layers["1"].attention.wq.recipe == "rowwise"
    assert set(model.state_dict()) == keys
    assert apply_float8(model, Float8(enable=False)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_torchao_float8_gives_our_outputs_and_gradients_bit_for_bit(recipe, dtype):
    """torchao's Float8Linear (emulated on the CPU, scales rounded to powers of two as ours) and ours: the same
    quantization and the same dequantized matmuls, so outputs and all gradients are equal, not merely close."""
    pytest.importorskip("torchao")
    import copy

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False)).to(dtype)
    x = torch.randn(4, 32, 64, dtype=dtype)
    got = {}
    for backend in ("titan", "torchao"):
        model = copy.deepcopy(base)
        assert apply_float8(model, Float8(enable=True, recipe=recipe, backend=backend, filter_fqns=[]),
                            torch.device("cpu")) == 2
        assert (type(model[0]).__module__.split(".")[0]) == backend
        xg = x.clone().requires_grad_()
        y = model(xg)
        y.float().square().sum().backward()
        got[backend] = [y, xg.grad, model[0].weight.grad, model[2].weight.grad]
    for ours, theirs in zip(got["titan"], got["torchao"]):
        assert torch.equal(ours, theirs)


def test_auto_backend_is_torchao_only_where_float8_kernels_run(monkeypatch):
    from titan.quantization import float8

    config = Float8(enable=True)
    assert float8.float8_backend(config, torch.device("cpu")) == "titan"
    monkeypatch.setattr(float8, "scaled_mm_supported", lambda device, recipe: True)
    have_torchao = float8.importlib.util.find_spec("torchao") is not None
    assert float8.float8_backend(config, torch.device("cuda")) == ("torchao" if have_torchao else "titan")
    assert float8.float8_backend(Float8(enable=True, backend="titan"), torch.device("cuda")) == "titan"


def test_torchao_float8_all_gather_on_gloo_is_refused_in_one_line():
    pytest.importorskip("torchao")
    from titan.tools.cli import UserError

    config = Float8(enable=True, backend="torchao", enable_fsdp_float8_all_gather=True)
    with pytest.raises(UserError, match="gloo cannot send: on a CPU pass --float8.backend titan"):
        apply_float8(nn.Sequential(nn.Linear(32, 32)), config, torch.device("cpu"))


@pytest.fixture(scope="module")
def bf16_losses(module_tmp_path):
    from tests.titan.conftest import TINY

    folder = module_tmp_path / "bf16"
    run_train([*TINY, *CURVE, "--job.dump_folder", str(folder)])
    return losses(folder)


# bf16 compute, a learning rate high enough that the loss moves, 8 steps.
CURVE = ["--training.mixed_precision_param", "bfloat16", "--training.steps", "8", "--optimizer.lr", "3e-3"]


@pytest.mark.parametrize(
    "recipe,layout,nproc",
    [("tensorwise", [], 1),
     ("rowwise", ["--training.local_batch_size", "1"], 2),
     pytest.param("tensorwise", ["--parallelism.tensor_parallel_degree", "2"], 2, marks=pytest.mark.slow)],
    ids=["tensorwise-1proc", "rowwise-fsdp2", "tensorwise-tp2"],
)
def test_float8_loss_curve_stays_close_to_bf16(tmp_path, tiny_args, bf16_losses, recipe, layout, nproc):
    run_train([*tiny_args, *CURVE, "--float8.enable", "--float8.recipe", recipe, *layout,
               "--job.dump_folder", str(tmp_path)], nproc=nproc)
    got = losses(tmp_path)
    assert len(got) == len(bf16_losses)
    assert got == pytest.approx(bf16_losses, abs=0.02)


def test_float8_all_gather_weight_is_checkpointed_as_its_plain_tensor(tmp_path):
    weight = torch.randn(32, 16)
    torch.save({"w": Float8AllGatherWeight(weight)}, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, weight)


def run_ranks(case: str, nproc: int, folder) -> list:
    """What `case` returned on each of `nproc` ranks of a gloo job (this module's __main__ runs it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_module("tests.titan.quantization.test_float8", ["case", case, str(folder)], env, nproc=nproc,
                      timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def _two_linears(w1: torch.Tensor, w2: torch.Tensor, use_scaled_mm: bool = False) -> nn.Sequential:
    model = nn.Sequential(Float8Linear(32, 64, bias=False, use_scaled_mm=use_scaled_mm), nn.ReLU(),
                          Float8Linear(64, 32, bias=False, use_scaled_mm=use_scaled_mm))
    with torch.no_grad():
        model[0].weight.copy_(w1)
        model[2].weight.copy_(w2)
    return model


def _plain(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain tensors, which a safe torch.load reads (TP's outputs are async collective tensors until waited)."""
    return [t.detach().clone() for t in tensors]


def _fsdp_tp_all_gather_case() -> tuple[list, list]:
    """On one rank of 4: outputs and gradients of FSDP 2 x TP 2, weights gathered in fp32, then in float8."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    w1, w2, x = torch.randn(64, 32), torch.randn(32, 64), torch.randn(8, 32)
    w1[32:] /= 64
    w2[:, 32:] /= 64
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def run(all_gather: bool, precompute: bool = False) -> list:
        model = _two_linears(w1, w2)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if all_gather:
            assert enable_float8_all_gather(model) == 2
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh["dp"])
        if precompute:
            precompute_float8_scales(model)
        xg = x.clone().requires_grad_()
        y = model(xg)
        y.sum().backward()  # backward gathers again, into the unsharded DTensor
        return _plain([y, xg.grad, *(p.grad.full_tensor() for p in model.parameters())])

    return run(False), run(True), run(True, precompute=True)


def _tp_scaled_mm_case() -> dict:
    """On one rank of 2: TP 2 in bf16 autocast through torch._scaled_mm (counted), then through the emulation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    w1, w2, x = torch.randn(64, 32), torch.randn(32, 64), torch.randn(16, 32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    calls, scaled_mm = [], torch._scaled_mm
    torch._scaled_mm = lambda *a, **k: calls.append(type(a[0]).__name__) or scaled_mm(*a, **k)

    def run(use_scaled_mm: bool) -> list:
        model = _two_linears(w1, w2, use_scaled_mm)
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(xg)
        y.float().sum().backward()
        return _plain([y, xg.grad, *(p.grad.full_tensor() for p in model.parameters())])

    return {"hardware": run(True), "emulated": run(False), "calls": calls}


CASES = {"fsdp_tp_all_gather": _fsdp_tp_all_gather_case, "tp_scaled_mm": _tp_scaled_mm_case}


def test_fsdp_float8_all_gather_with_tensor_parallel_is_exact(tmp_path):
    """FSDP 2 x TP 2 (TorchTitan's 405B recipe enables both): gathering the weights in float8 gives the outputs and
    gradients of gathering them in fp32, bit for bit, because the scale is the whole weight's; the TP halves
    differ 64x in magnitude, so per-TP-shard scales would not (checked: 4e-6 off)."""
    for plain, fp8, precomputed in run_ranks("fsdp_tp_all_gather", 4, tmp_path):
        assert all(torch.equal(a, b) for a, b in zip(plain, fp8))
        assert all(torch.equal(a, b) for a, b in zip(plain, precomputed)), "one batched amax: the same scales"


def test_tensorwise_tensor_parallel_runs_scaled_mm_on_dtensors(tmp_path):
    """TP 2 (colwise then rowwise, bf16): every matmul of forward and backward goes through torch._scaled_mm on
    DTensors (run on the CPU, where it exists), and gives the emulation's outputs and gradients."""
    for rank in run_ranks("tp_scaled_mm", 2, tmp_path):
        assert rank["calls"] == ["DTensor"] * 6  # 2 layers x (forward, grad_input, grad_weight)
        for a, b in zip(rank["hardware"], rank["emulated"]):
            torch.testing.assert_close(a, b)


@pytest.fixture(scope="module")
def fsdp_all_gather_runs(module_tmp_path):
    """Two 2-rank FSDP float8 runs of 3 steps in one torchrun, without and with float8 all-gather; collectives
    counted over steps 2-3 (see _worker)."""
    from tests.titan.conftest import TINY

    out = module_tmp_path / "fp8_all_gather"
    out.mkdir()
    run_train([str(out / "runs.json"), *TINY, *CURVE, "--training.steps", "3", "--training.local_batch_size", "1",
               "--float8.enable", "--job.dump_folder", str(out / "run")],
              nproc=2, module="tests.titan.quantization.test_float8", timeout=180)
    return json.loads((out / "runs.json").read_text())


def test_fsdp_float8_all_gather_halves_the_weight_bytes_and_keeps_the_losses(fsdp_all_gather_runs):
    plain, fp8 = fsdp_all_gather_runs["false"], fsdp_all_gather_runs["true"]
    # bf16 parameters gather 2 bytes an element, float8 weights 1: each gather of a float8 weight saves its numel.
    # Per step, forward gathers every block, backward all but the last (it stays gathered).
    gathers_per_step = 2 * plain["blocks"] - 1
    saved = plain["float8_weight_numel_per_block"] * gathers_per_step * 2
    assert plain["all_gather_bytes"] - fp8["all_gather_bytes"] == saved
    # The scales: one all-reduce of every weight's amax per step (after the optimizer step), none per gather.
    assert fp8["all_reduce_calls"] - plain["all_reduce_calls"] == 2
    assert len(fp8["losses"]) == 3
    assert fp8["losses"] == pytest.approx(plain["losses"], abs=0.02)


def _worker(out_path: str, train_args: list[str]) -> None:
    import torch.distributed as dist

    from titan.config import parse_args
    from titan.distributed.comm_stats import CommStats
    from titan.trainer import Trainer

    results = {}
    for flag in ("false", "true"):
        config = parse_args([*train_args, "--float8.enable_fsdp_float8_all_gather", flag,
                             "--job.dump_folder", f"{train_args[-1]}_{flag}"])
        trainer = Trainer(config)
        # Step 1 outside the count: DTensor's first sharding propagation runs fake tensors CommStats rejects.
        trainer.config.training.steps = 1
        trainer.train()
        trainer.config.training.steps = 3
        with CommStats() as stats:
            trainer.train()
        trainer.close()
        table = stats.table()
        block = next(iter(trainer.model.layers.values()))
        results[flag] = {
            "losses": [r["loss"] for r in trainer.history],
            "all_gather_bytes": sum(v["bytes"] for (kind, _), v in table.items() if kind == "all_gather"),
            "all_reduce_calls": sum(v["calls"] for (kind, _), v in table.items() if kind == "all_reduce"),
            "blocks": len(trainer.model.layers),
            "float8_weight_numel_per_block": sum(m.weight.numel() for m in block.modules()
                                                 if isinstance(m, Float8Linear)),
        }
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    import torch.distributed as dist

    from titan.distributed.runtime import shutdown

    if sys.argv[1] == "case":  # a rank of run_ranks
        dist.init_process_group("gloo")
        torch.save(CASES[sys.argv[2]](), f"{sys.argv[3]}/rank{dist.get_rank()}.pt")
        dist.destroy_process_group()
    else:
        _worker(sys.argv[1], sys.argv[2:])
        shutdown()
