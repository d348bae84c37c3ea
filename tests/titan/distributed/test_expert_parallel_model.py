"""A DeepSeek-V3 model trained 3 AdamW steps with expert parallel gives the one-process losses and gradient norms
(fp32, 1e-5): EP 2 over 2 ranks (experts sharded over the expert group only) and EP 2 x FSDP 2 over 4 ranks
(experts also FSDP-sharded over the other data-parallel ranks, which makes their gradients 2-D DTensors whose
norm clip_grad_norm_ must sum over both dims, also when FSDP shards each expert's rows); the selection biases
move."""

import os
import sys

import pytest
import torch

from tests.launch import run_module

TOKENS_PER_RANK = (2, 16)


def _model(experts: int):
    from titan.models.deepseek_v3.model import ModelArgs, Transformer

    args = ModelArgs(dim=32, n_layers=3, n_dense_layers=1, n_heads=2, vocab_size=64, inter_dim=64, moe_inter_dim=16,
                     n_routed_experts=experts, n_shared_experts=1, n_activated_experts=min(2, experts // 2),
                     n_expert_groups=2 if experts >= 4 else 1, n_limited_groups=1, kv_lora_rank=16,
                     qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     rope_factor=1.0, rope_mscale=0.0, rope_mscale_all_dim=0.0, max_seq_len=16,
                     bias_update_rate=1e-2)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _train(model, tokens_fn, group=None) -> list[tuple[float, float]]:
    """3 steps: loss, backward, clipped gradient norm, AdamW, the experts' bias update; (loss, grad norm) each."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from titan.distributed.utils import clip_grad_norm_
    from titan.models.common.moe_load import expert_load_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    records = []
    for step in range(3):
        tokens = tokens_fn(step)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        norm = clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        expert_load_step(model, group=group)
        if group is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        records.append((loss.item(), norm.item()))
    return records


def _batch(step: int, world: int) -> torch.Tensor:
    B, T = TOKENS_PER_RANK
    return torch.randint(0, 64, (world * B, T + 1), generator=torch.Generator().manual_seed(step))


def _worker(out: str, experts: int) -> None:
    import torch.distributed as dist

    from titan.config import parse_args
    from titan.distributed import ParallelDims, apply_data_parallel
    from titan.distributed.expert_parallel import apply_moe_data_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _train(_model(experts), lambda step: _batch(step, world))
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world, ep=2)
    dims.build_mesh("cpu")
    config = parse_args(["--training.mixed_precision_param", "float32"])
    model = _model(experts)
    ignored = apply_moe_data_parallel(model, dims, config)
    apply_data_parallel(model, dims, config, ignored_params=ignored)
    B = TOKENS_PER_RANK[0]
    got = _train(model, lambda step: _batch(step, world)[rank * B:(rank + 1) * B], group=dist.group.WORLD)
    bias = torch.stack([m.router.expert_bias for n, m in model.named_modules() if n.endswith("moe")])
    if rank == 0:
        w1 = model.layers["1"].moe.experts.w1
        torch.save({"reference": reference, "got": got, "bias": bias, "ignored": len(ignored),
                    "sharded_dims": [p.dim for p in w1.placements]}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world, experts, ignored, sharded_dims", [
    (2, 8, 6, [0]), (4, 8, 0, [0, 0]), (4, 2, 0, [1, 0]),
], ids=["ep2", "ep2-fsdp2", "ep2-fsdp2-one-expert-a-rank"])
def test_expert_parallel_training_equals_one_process(tmp_path, world, experts, ignored, sharded_dims):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "result.pt"
    proc = run_module("tests.titan.distributed.test_expert_parallel_model", [str(out), str(experts)], env,
                      nproc=world, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out, weights_only=True)
    # EP 2 on 2 ranks: no data-parallel rank outside the expert group, so FSDP leaves the 2 layers x 3 expert
    # weights alone; on 4 ranks they are FSDP units of their own, sharded on the expert dim, or on the next one
    # when a rank computes fewer experts (1 of 2) than FSDP has shards (2).
    assert result["sharded_dims"] == sharded_dims
    assert result["ignored"] == ignored
    for (loss, norm), (want_loss, want_norm) in zip(result["got"], result["reference"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert norm == pytest.approx(want_norm, rel=1e-5)
    assert result["bias"].abs().sum() > 0  # the aux-loss-free update ran


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
