"""The default training loss."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100  # F.cross_entropy's default: labels equal to it count neither in the loss nor in the mean

# Rows of logits per chunk of the CPU path: about 2 MB of fp32, so that each chunk stays in the cache.
CHUNK_FLOATS = 1 << 19


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32; `pred` is (..., V) logits, `labels` matches its leading dims."""
    pred, labels = pred.flatten(0, -2), labels.flatten(0, -1)
    if pred.device.type == "cpu" and not isinstance(pred, DTensor) and not torch.compiler.is_compiling():
        return ChunkedCrossEntropy.apply(pred, labels)
    return nn.functional.cross_entropy(pred.float(), labels, ignore_index=IGNORE_INDEX)


class ChunkedCrossEntropy(torch.autograd.Function):
    """F.cross_entropy of the logits in fp32, a few rows at a time, and its gradient in the logits' dtype.

    On a CPU the whole fp32 copy of the logits, its log-softmax and the gradient are fresh buffers of tens of MB
    each step (every page faulted in and zeroed by the kernel); per chunk they stay in the cache (debug model:
    the loss's forward and backward 4x faster). Saves the logits themselves, not their fp32 log-softmax."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        valid_N = labels_N != IGNORE_INDEX
        targets_N1 = labels_N.where(valid_N, 0)[:, None]
        rows = max(1, CHUNK_FLOATS // logits_NV.shape[1])
        total = torch.zeros((), dtype=torch.float32, device=logits_NV.device)
        for x, t, ok in zip(logits_NV.split(rows), targets_N1.split(rows), valid_N.split(rows)):
            picked = torch.log_softmax(x.float(), -1).gather(-1, t).squeeze(-1)
            total -= picked.where(ok, 0).sum()
        count = valid_N.sum()
        ctx.save_for_backward(logits_NV, targets_N1, valid_N, count)
        ctx.rows = rows
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits_NV, targets_N1, valid_N, count = ctx.saved_tensors
        grad_NV = torch.empty_like(logits_NV)
        # d loss / d logits = (softmax - one-hot of the label) / count on counted rows, 0 on ignored ones.
        scale_N1 = (valid_N * (grad / count))[:, None]
        for x, t, s, out in zip(logits_NV.split(ctx.rows), targets_N1.split(ctx.rows), scale_N1.split(ctx.rows),
                                grad_NV.split(ctx.rows)):
            p = torch.softmax(x.float(), -1)
            p.scatter_add_(-1, t, torch.full_like(t, -1, dtype=p.dtype))
            torch.mul(p, s, out=out)
        return grad_NV, None
