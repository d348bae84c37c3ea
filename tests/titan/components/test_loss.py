"""The default loss: mean token cross-entropy, computed in fp32 whatever the logits' dtype."""

import torch

from titan.components import loss as loss_module
from titan.components.loss import cross_entropy_loss


def test_loss_is_the_mean_negative_log_probability_of_each_label():
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 3, 5, generator=gen), torch.randint(0, 5, (2, 3), generator=gen)
    by_hand = -sum(logits[b, t, labels[b, t]] - logits[b, t].exp().sum().log() for b in range(2) for t in range(3)) / 6
    torch.testing.assert_close(cross_entropy_loss(logits, labels), by_hand, rtol=1e-6, atol=1e-6)


def test_bf16_logits_give_the_fp32_loss_of_the_same_values():
    gen = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(4, 7, generator=gen).bfloat16(), torch.randint(0, 7, (4,), generator=gen)
    loss = cross_entropy_loss(logits, labels)
    assert loss.dtype == torch.float32
    assert loss.item() == torch.nn.functional.cross_entropy(logits.float(), labels).item()


def _both(logits, labels):
    """(loss, gradient) of ours and of F.cross_entropy on the fp32 logits, gradients in the logits' dtype."""
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy_loss(ours, labels)
    loss.backward()
    want = torch.nn.functional.cross_entropy(ref.float().flatten(0, -2), labels.flatten())
    want.backward()
    return (loss, ours.grad), (want, ref.grad)


def test_chunks_of_rows_give_the_loss_and_gradient_of_the_whole(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_FLOATS", 3 * 11)  # 3 rows a chunk: 7 chunks, the last one short
    gen = torch.Generator().manual_seed(2)
    logits, labels = 3 * torch.randn(4, 5, 11, generator=gen), torch.randint(0, 11, (4, 5), generator=gen)
    (loss, grad), (want, want_grad) = _both(logits, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)


def test_bf16_logits_get_a_bf16_gradient_rounded_from_the_fp32_one(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_FLOATS", 4 * 64)
    gen = torch.Generator().manual_seed(3)
    logits, labels = (3 * torch.randn(32, 64, generator=gen)).bfloat16(), torch.randint(0, 64, (32,), generator=gen)
    (loss, grad), (want, want_grad) = _both(logits, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2**-8, atol=1e-9)  # one bf16 rounding apart


def test_labels_of_minus_100_count_neither_in_the_loss_nor_in_the_mean(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_FLOATS", 2 * 9)
    gen = torch.Generator().manual_seed(4)
    logits, labels = torch.randn(10, 9, generator=gen), torch.randint(0, 9, (10,), generator=gen)
    labels[[1, 4, 5]] = -100
    (loss, grad), (want, want_grad) = _both(logits, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-8)
    assert not grad[[1, 4, 5]].any()
