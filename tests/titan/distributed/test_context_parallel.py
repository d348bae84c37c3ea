"""Context parallel on the CPU: the CPU flash-attention kernel goes through the ring-attention templates, the loss
and gradients are the unsharded model's, and the positional buffer is restored after the step."""

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from titan.distributed import context_parallel
from titan.models.llama3.model import ModelArgs, Transformer

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def test_a_one_rank_ring_gives_the_plain_loss_and_gradients(world_of_one, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    inputs, labels = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    rope, rings = model.rope_cache.clone(), []
    ring_forward = context_parallel._ring_forward
    monkeypatch.setattr(context_parallel, "_ring_forward", lambda *a, **k: rings.append(1) or ring_forward(*a, **k))
    with context_parallel.sequence_sharded(init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)), [model], inputs,
                                           labels):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
    assert rings == [1]  # one attention layer, one ring forward
    for got, want in zip((p.grad for p in model.parameters()), reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(model.rope_cache, rope)
