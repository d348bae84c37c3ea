"""Mixture of experts: a token-choice top-k router, routed SwiGLU experts held as grouped weights, optional shared
experts, and the routing records behind the balance losses (titan.models.common.moe_balance) and DeepSeek-V3's
selection-bias balancing.

    moe = MoE(dim, MoEArgs(num_experts=8, top_k=2, hidden_dim=64))
    y_BTD = moe(x_BTD)

Routing is dropless: every token reaches its k experts whatever the load, so the output does not depend on how the
experts are laid out over ranks. The experts run through `torch._grouped_mm` where the device and dtype have it and
through one matmul per expert on the same sorted tokens elsewhere (float64 among them); both give the same result.
Expert parallelism replaces `MoE.experts` from outside (titan.distributed.expert_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan.models.common.decoder import FeedForward
from titan.tools.cli import UserError


@dataclass
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 256
    """Hidden size of each routed expert's SwiGLU (HF moe_intermediate_size)."""
    num_shared_experts: int = 0
    """Shared experts see every token: one SwiGLU of hidden_dim * num_shared_experts (HF n_shared_experts)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """softmax over the experts (Qwen3-MoE) or an independent sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = False
    """Renormalise the k chosen scores to sum to 1 (HF norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiplies the routing weights after normalisation (HF routed_scaling_factor)."""
    n_groups: int = 1
    topk_groups: int = 1
    """Group-limited routing: experts fall into n_groups groups, a token picks its topk_groups best groups (each
    scored by its two best experts) and its k experts only among them (HF n_group, topk_group)."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every expert's selection bias moves
    by this much towards balance (up when under-loaded). 0 keeps the bias as loaded."""
    aux_loss_coef: float = 0.0
    """Weight of the balance loss (Qwen3-MoE's HF router_aux_loss_coef, DeepSeek-V3's seq_aux_loss_alpha): in
    training each layer records its routing, and the model adds coef x the loss to the gradient
    (moe_balance.add_balance_loss). The Switch losses (all_layers, per_layer) are taken per forward shard, over the
    tokens a rank routes in one forward (a micro-batch of its data-parallel batch, under tensor parallel its
    sequence shard; whole sequences under context parallel), and so averaged over those shards, not taken over the
    global batch; under pipeline parallel over each stage's own layers (see balance_loss)."""
    balance_loss: Literal["all_layers", "per_layer", "per_sequence"] = "all_layers"
    """all_layers: transformers' loss, one Switch loss over all the layers' routing at once (the experts' counts
    summed over layers are balanced, single layers may stay skewed; under pipeline parallel taken per stage, an
    approximation). per_layer: each layer's own Switch loss E * sum_e f_e P_e (f_e counting a token's k copies, as
    transformers' does; Megatron-LM's divides by k), summed over the layers as TorchTitan and Megatron-LM do (each
    layer adds coef x its own loss), so that every layer is balanced; separable, so pipeline parallel gives the
    one-process loss exactly. per_sequence: DeepSeek-V3's complementary sequence-wise loss of each layer, averaged
    over the sequences and summed over the layers (moe_balance.sequence_balance_loss), exact under every layout."""
    use_grouped_mm: bool = True

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts or self.hidden_dim <= 0:
            raise UserError(f"moe needs num_experts > 0, 0 < top_k <= num_experts and hidden_dim > 0, got "
                            f"{self.num_experts}, {self.top_k}, {self.hidden_dim}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise UserError(f"moe score_func must be softmax or sigmoid, got {self.score_func!r}")
        if self.num_experts % self.n_groups or not 0 < self.topk_groups <= self.n_groups:
            raise UserError(f"moe n_groups {self.n_groups} must divide num_experts {self.num_experts} and "
                            f"0 < topk_groups <= n_groups, got topk_groups {self.topk_groups}")
        if self.n_groups > 1 and (self.num_experts // self.n_groups < 2
                                  or self.top_k > self.topk_groups * (self.num_experts // self.n_groups)):
            raise UserError(f"moe group-limited routing needs >= 2 experts a group and top_k <= topk_groups * "
                            f"experts a group, got {self.num_experts} experts in {self.n_groups} groups, top_k "
                            f"{self.top_k}, topk_groups {self.topk_groups}")
        if self.num_shared_experts < 0 or self.bias_update_rate < 0 or self.aux_loss_coef < 0:
            raise UserError("moe num_shared_experts, bias_update_rate and aux_loss_coef must be >= 0")
        if self.balance_loss not in ("all_layers", "per_layer", "per_sequence"):
            raise UserError(f"moe balance_loss must be all_layers, per_layer or per_sequence, got "
                            f"{self.balance_loss!r}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Routing and the weighted sum run in at least float32 (bf16 scores would flip close top-k choices)."""
    return torch.promote_types(dtype, torch.float32)


def _experts_dtype(x: torch.Tensor) -> torch.dtype:
    """The experts compute in autocast's dtype where it is on, as nn.Linear would (the grouped GEMM has no
    autocast rule of its own)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class TopKRouter(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.gate.keep_high_precision = True  # float8 training leaves it alone (titan.quantization.float8)
        # Selection bias (HF e_score_correction_bias): shifts which experts are chosen, never the weights.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=args.score_func == "sigmoid")

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routing weights (T, k), chosen experts (T, k) and every expert's score (T, E)."""
        a = self.args
        dtype = _compute_dtype(x_TD.dtype)
        with torch.autocast(x_TD.device.type, enabled=False):  # autocast would make the logits bf16
            logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
        if a.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
            weights_TK, experts_TK = scores_TE.topk(a.top_k, dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
            choice_TE = scores_TE + self.expert_bias.to(dtype)
            if a.n_groups > 1:
                per_group = a.num_experts // a.n_groups
                choice_TGP = choice_TE.view(-1, a.n_groups, per_group)
                group_score_TG = choice_TGP.topk(2, dim=-1).values.sum(dim=-1)
                groups_TG = group_score_TG.topk(a.topk_groups, dim=-1, sorted=False).indices
                keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, groups_TG, True)
                choice_TE = choice_TGP.masked_fill(~keep_TG[..., None], float("-inf")).view_as(choice_TE)
            experts_TK = choice_TE.topk(a.top_k, dim=-1, sorted=False).indices
            weights_TK = scores_TE.gather(1, experts_TK)
        if a.route_norm:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return weights_TK * a.route_scale, experts_TK, scores_TE

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        self.expert_bias.zero_()


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three [E, out, in] tensors (nn.Linear's layout per expert)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # down
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # up

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ND: token copies sorted by expert, counts_E[e] of them for expert e, in order."""
        # Local experts under expert parallel; the compute dtype where FSDP's mixed precision does not cast them.
        w1, w2, w3 = ((w.to_local() if isinstance(w, DTensor) else w).to(x_ND.dtype)
                      for w in (self.w1, self.w2, self.w3))
        if self.use_grouped_mm and grouped_mm_supported(x_ND):
            offsets = counts_E.cumsum(0).to(torch.int32)
            # The grouped GEMM rejects a zero-stride gradient (e.g. from out.sum()); contiguous() gives it strides.
            h = F.silu(torch._grouped_mm(x_ND, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x_ND, w3.transpose(-2, -1), offs=offsets)
            return _ContiguousGrad.apply(torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets))
        counts = counts_E.tolist()
        if torch.compiler.is_compiling():
            # The loop's in-place writes do not trace inside an autograd.Function; compiled, the graph places the
            # pieces itself. unbind: one gradient buffer per weight, where indexing w[e] would make one per expert.
            return torch.cat([F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d) for x, g, d, u
                              in zip(torch.split(x_ND, counts), w1.unbind(), w2.unbind(), w3.unbind())])
        return _ExpertLoop.apply(x_ND, w1, w2, w3, counts)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch._grouped_mm exists for float32 and bfloat16 on the CPU; on CUDA for bfloat16 from sm90 on. Compiled,
    bfloat16 only: the meta function torch.compile traces it with refuses other dtypes."""
    if not hasattr(torch, "_grouped_mm") or torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class _ExpertLoop(torch.autograd.Function):
    """The experts one matmul at a time on their slices of x_ND, every output and gradient written in place into
    one tensor (no concatenation of per-expert pieces, no stacking of per-expert weight gradients); each expert's
    elementwise ops stay on its own slice, which the cache still holds."""

    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
        y_ND = x_ND.new_empty(x_ND.shape[0], w2.shape[1])
        saved = []
        for e, (x, y) in enumerate(zip(x_ND.split(counts), y_ND.split(counts))):
            gate, up = torch.mm(x, w1[e].t()), torch.mm(x, w3[e].t())
            act = F.silu(gate)
            h = act * up
            torch.mm(h, w2[e].t(), out=y)
            saved += [gate, act, up, h]
        ctx.save_for_backward(x_ND, w1, w2, w3, *saved)
        ctx.counts = counts
        return y_ND

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x_ND, w1, w2, w3, *saved = ctx.saved_tensors
        grad_ND = grad_ND.contiguous()
        grad_x, grad_w1, grad_w2, grad_w3 = (torch.empty_like(t) for t in (x_ND, w1, w2, w3))
        slices = zip(x_ND.split(ctx.counts), grad_ND.split(ctx.counts), grad_x.split(ctx.counts))
        for e, (x, grad_y, gx) in enumerate(slices):
            gate, act, up, h = saved[4 * e:4 * e + 4]
            torch.mm(grad_y.t(), h, out=grad_w2[e])
            grad_h = torch.mm(grad_y, w2[e])
            grad_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
            grad_up = grad_h.mul_(act)
            torch.mm(grad_gate, w1[e], out=gx)
            gx.addmm_(grad_up, w3[e])
            torch.mm(grad_gate.t(), x, out=grad_w1[e])
            torch.mm(grad_up.t(), x, out=grad_w3[e])
        return grad_x, grad_w1, grad_w2, grad_w3, None


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _index_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # The CPU's index_select copies 16-bit integer rows 2-3x faster than bf16 ones (measured, torch 2.14): same bits.
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16).index_select(0, index).view(x.dtype)
    return x.index_select(0, index)


class GatherRows(torch.autograd.Function):
    """x.index_select(0, index) whose backward gathers too: the gradient's rows at `back`, summed in groups of
    `copies` (the copies of each row of x that `index` makes). Moving token copies between token order and expert
    order, each direction is the other's backward; indexing would differentiate into an index_put with accumulate,
    one element at a time on the CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor, copies: int) -> torch.Tensor:
        ctx.save_for_backward(back)
        # Given, not len(back) // len(x): under expert parallel and torch.compile len(x) is a data-dependent size.
        ctx.copies = copies
        return _index_rows(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (back,) = ctx.saved_tensors
        if ctx.copies > 1:  # one embedding_bag: gathered and summed without the gathered copies in between
            return F.embedding_bag(back.view(-1, ctx.copies), grad, mode="sum"), None, None, None
        return _index_rows(grad, back), None, None, None


class Combine(torch.autograd.Function):
    """Each token's k expert outputs weighted and summed straight from expert order:
    out_TD[t] = sum_j w_TK[t, j] * y_ND[slot_N[t * k + j]], where order_N = slot_N's inverse. One embedding_bag
    (accumulating in fp32, as a batched product would; 16-bit results round ties away from zero) instead of a gather
    that copies every output once more then a product. In backward the tokens' gradient is gathered once into
    expert order: times the weights it is the outputs' gradient, and multiplied by the outputs and summed over the
    features, the weights' (as transformers differentiates its `output * weight`: products in the dtype, summed in
    fp32)."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, w_TK: torch.Tensor, slot_N: torch.Tensor,
                order_N: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y_ND, w_TK, slot_N, order_N)
        return F.embedding_bag(slot_N.view_as(w_TK), y_ND, mode="sum", per_sample_weights=w_TK)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        y_ND, w_TK, slot_N, order_N = ctx.saved_tensors
        grad_ND = _index_rows(grad_TD, order_N // w_TK.shape[1])
        grad_w = (y_ND * grad_ND).sum(-1)[slot_N].view_as(w_TK) if ctx.needs_input_grad[1] else None
        grad_y = grad_ND.mul_(w_TK.flatten()[order_N].unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None


def expert_counts(experts_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token copies routed to each expert; a scatter, not bincount, whose output size depends on the data (a graph
    break under torch.compile)."""
    experts_N = experts_TK.flatten()
    return experts_N.new_zeros(num_experts).scatter_add_(0, experts_N, torch.ones_like(experts_N))


def sequence_stats(scores_TE: torch.Tensor, experts_TK: torch.Tensor,
                   sequences: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Routing of each of the `sequences` whose tokens are the rows of scores_TE, in order, for the sequence-wise
    balance loss: the scores normalized over the experts (s_t / sum_j s_jt) summed over each sequence's tokens
    (B, E), how many of its tokens chose each expert (B, E), and its tokens on this rank."""
    chosen_TE = torch.zeros_like(scores_TE).scatter_(1, experts_TK, 1.0)
    probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    tokens = scores_TE.shape[0] // sequences
    return (probs_TE.view(sequences, tokens, -1).sum(dim=1), chosen_TE.view(sequences, tokens, -1).sum(dim=1),
            tokens)


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = (FeedForward(dim, args.hidden_dim * args.num_shared_experts)
                               if args.num_shared_experts else None)
        # Routed token copies per expert since the last expert_load_step: the balancing bias and the metrics read it.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.aux_loss_scale = 1.0
        """The trainer sets 1 / (micro-batches x accumulation steps), the scale of each forward batch's loss."""
        self.aux_loss_group = None
        """The ranks holding the rest of each sequence: context parallel, with per_sequence tensor parallel too
        (moe_balance.set_aux_loss_scale)."""
        self.balance_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """This forward's routing for the balance loss: probabilities summed over the tokens, copies per expert,
        tokens (only in training with aux_loss_coef); per_sequence: each of those per sequence (sequence_stats)."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        weights_TK, experts_TK, scores_TE = self.router(x_TD)
        counts_E = expert_counts(experts_TK, self.args.num_experts)
        # Training only (validation must not move the balance), and not an activation-checkpoint recompute inside
        # backward (compiled, checkpointing recomputes in the graph).
        if self.training and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1):
            with torch.no_grad():
                self.tokens_per_expert.add_(counts_E)
            if self.args.aux_loss_coef and torch.is_grad_enabled():
                self.balance_stats = (sequence_stats(scores_TE, experts_TK, x_BTD.shape[0])
                                      if self.args.balance_loss == "per_sequence"
                                      else (scores_TE.sum(dim=0), counts_E, x_TD.shape[0]))
        # Token copies sorted by expert (stable: each expert sees its tokens in order); slot_N: where each copy
        # (token t's j-th choice, row t * k + j) went.
        order_N = experts_TK.flatten().argsort(stable=True)
        slot_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=x_TD.device))
        x_ND = GatherRows.apply(x_TD.to(_experts_dtype(x_TD)), order_N // self.args.top_k, slot_N,
                                self.args.top_k)
        y_ND = self.experts(x_ND, counts_E)
        # Each token's k outputs weighted and summed in the experts' dtype.
        out_TD = Combine.apply(y_ND, weights_TK.to(y_ND.dtype), slot_N, order_N).to(x_TD.dtype)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view_as(x_BTD)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Zeroes what no checkpoint holds (after `to_empty`): the token counts, and the selection bias of softmax
        routing, which has none."""
        self.tokens_per_expert.zero_()
        if self.args.score_func == "softmax":
            self.router.expert_bias.zero_()
