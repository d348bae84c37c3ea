"""The default loss: mean token cross-entropy, computed in fp32 whatever the logits' dtype."""

import torch

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
