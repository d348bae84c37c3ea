"""The training step's collectives and contexts on one process: the gradient norm and clipping agree with
torch's clip_grad_norm_, and mixed precision is autocast only where FSDP does not cast."""

import pytest
import torch

from titan.distributed.utils import autocast_context, clip_grad_norm_


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_the_norm_and_the_clipped_gradients_are_torchs(max_norm):
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(8, 64)
    for model in (ours, ref):
        (model(x) ** 2).sum().backward()
    norm = clip_grad_norm_(list(ours.parameters()), max_norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm > 0 else float("inf"))
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_the_norm_accumulates_in_float64():
    grads = [torch.full((1_000_000,), 1e-3) for _ in range(3)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    exact = 3e6**0.5 * torch.tensor(1e-3).item()  # the float32 value of 1e-3, in float64 arithmetic
    assert clip_grad_norm_(params, 0.0).item() == pytest.approx(exact, rel=1e-9)
    # what float32 accumulation would give: off by ~6e-4, enough for layouts to disagree on the clip factor
    assert abs(torch.linalg.vector_norm(torch.cat(grads)).item() / exact - 1) > 1e-4


def test_autocast_only_for_an_unsharded_low_precision_run():
    cpu = torch.device("cpu")
    with autocast_context(cpu, sharded=False, dtype=torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    for sharded, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        with autocast_context(cpu, sharded=sharded, dtype=dtype):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
