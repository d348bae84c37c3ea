"""Float8 training of linear layers with dynamic scaling, as TorchAO's tensorwise and rowwise recipes.

Every matmul of a Float8Linear (forward, grad_input, grad_weight) quantizes both operands just in time:
e4m3 for weights and activations, e5m2 (tensorwise) or e4m3 (rowwise) for output gradients. Tensorwise
uses one scale per tensor; rowwise one scale per row of the contraction, so each operand is re-quantized
along the dimension its matmul contracts (the high-precision inputs are saved for backward, as nn.Linear
saves them anyway).

Scales are rounded down to powers of two: dequantized float8 values are then exact in bf16, so the
emulation (dequantize, matmul in the compute dtype) equals `torch._scaled_mm` up to summation order.
`_scaled_mm` runs where it is fast (CUDA sm89+, sm90+ for rowwise); elsewhere, e.g. on the CPU where it
exists but is several times slower than a bf16 matmul, and for rowwise under tensor parallel, we emulate. Tensorwise
under TP calls `_scaled_mm` on the DTensors (torch shards it, with the scales replicated).

With FSDP2, tensorwise weights can also be all-gathered in float8 (Float8AllGatherWeight), with tensor parallel
too: each shard is quantized with the scale of the whole weight's amax (over the FSDP and TP groups), and the
gathered weight is dequantized into the compute dtype, exactly, so the matmul's own quantization of it loses
nothing more. `precompute_float8_scales` finds every such weight's amax in one all-reduce after the optimizer step,
as torchao's precompute_float8_dynamic_scale_for_fsdp does.

`float8.backend` auto uses torchao's Float8Linear (the `float8` extra) where its float8 kernels run (CUDA sm89+,
sm90+ for rowwise); this module's classes remain for the CPU and as the reference torchao is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan.tools.cli import UserError
from titan.tools.logging import logger

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GRAD_DTYPES = {"tensorwise": E5M2, "rowwise": E4M3}
# _scaled_mm needs the contraction and output dims to be multiples of 16; the module filter uses the same rule.
FP8_ALIGNMENT = 16


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None,
             amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts `t` to float8 with its absolute max (whole tensor, or per slice along `dim`; or `amax` when given,
    e.g. that of all shards) scaled to the format's max; returns the float8 tensor and the fp32 inverse scale
    that dequantizes it."""
    fp8_max = torch.finfo(dtype).max
    if amax is None:
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(fp8_max / amax.float().clamp(min=1e-12))))
    t8 = (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return t8, scale.reciprocal()


def scaled_mm_supported(device: torch.device, recipe: str) -> bool:
    """Whether `torch._scaled_mm` has fast float8 kernels for this recipe on `device`."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    needed = (9, 0) if recipe == "rowwise" else (8, 9)
    return torch.cuda.get_device_capability(device) >= needed


@functools.cache
def cpu_scaled_mm_supported(recipe: str) -> bool:
    """Whether this torch's CPU `_scaled_mm` runs `recipe`: rowwise scales came after torch 2.11, whose CPU kernel
    takes per-tensor scales only (a one-off 16 x 16 probe). Training never calls it on a CPU; the tests that run
    the hardware path there skip, saying why, where it is missing."""
    if recipe != "rowwise":
        return True
    a8 = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a8, a8.t().contiguous().t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


CPU_ROWWISE_MISSING = (f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only "
                       "(rowwise: a newer torch)")


def float8_mm(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool,
              use_scaled_mm: bool) -> torch.Tensor:
    """a (M, K) @ b (K, N) with both operands quantized dynamically; the result has a's dtype."""
    out_dtype = a.dtype
    a8, a_inv = quantize(a, a_dtype, dim=1 if rowwise else None)
    b8, b_inv = quantize(b, b_dtype, dim=0 if rowwise else None)
    if use_scaled_mm:
        # _scaled_mm wants a row-major and b column-major.
        b8 = b8.t().contiguous().t()
        return torch._scaled_mm(a8.contiguous(), b8, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return torch.mm((a8.float() * a_inv).to(out_dtype), (b8.float() * b_inv).to(out_dtype))


def _hardware_path(use_scaled_mm: bool, rowwise: bool, *operands: torch.Tensor) -> bool:
    """_scaled_mm takes bf16-producing operands whose (local) dims are aligned. Under tensor parallel DTensor runs
    it shard by shard with the tensorwise scales replicated; rowwise TP is emulated, because DTensor gives a
    rowwise scale its operand's placement, which is wrong where the contraction dim is sharded."""
    if not use_scaled_mm or (rowwise and any(isinstance(t, DTensor) for t in operands)):
        return False
    local = [t.to_local() if isinstance(t, DTensor) else t for t in operands]
    return all(t.dtype == torch.bfloat16 and all(d % FP8_ALIGNMENT == 0 for d in t.shape) for t in local)


class _Float8Matmul(torch.autograd.Function):
    """y = x @ w.T with float8 forward, grad_input and grad_weight matmuls."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str, use_scaled_mm: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.use_scaled_mm = recipe, use_scaled_mm
        rowwise = recipe == "rowwise"
        return float8_mm(x, w.t(), E4M3, E4M3, rowwise, _hardware_path(use_scaled_mm, rowwise, x, w))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, w = ctx.saved_tensors
        rowwise, grad_dtype = ctx.recipe == "rowwise", GRAD_DTYPES[ctx.recipe]
        hardware = _hardware_path(ctx.use_scaled_mm, rowwise, grad_y, x, w)
        grad_x = float8_mm(grad_y, w, grad_dtype, E4M3, rowwise, hardware)
        grad_w = float8_mm(grad_y.t(), x, grad_dtype, E4M3, rowwise, hardware)
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in float8; parameters and state-dict keys are those of nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: str = "tensorwise", use_scaled_mm: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.use_scaled_mm = use_scaled_mm

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str, use_scaled_mm: bool) -> Float8Linear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe, use_scaled_mm=use_scaled_mm)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast does not reach inside the custom matmul: cast to its compute dtype here.
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        y = _Float8Matmul.apply(x2, self.weight.to(dtype), self.recipe, self.use_scaled_mm)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, scaled_mm={self.use_scaled_mm}"


# The ops FSDP2 uses to shard, pad, copy and move a parameter: their results stay wrapped, so the sharded
# local tensor keeps the all-gather hooks. Every other op (optimizer, init, state dict) sees the plain tensor.
_KEEP_WRAPPER = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision Float8Linear weight that FSDP2 all-gathers in float8 through its tensor-subclass hooks.

    Under tensor parallel it is the local tensor of the TP DTensor (FSDP shards that one), and `amax_groups`
    holds the TP group: the scale is then that of the whole weight, as the matmul's own quantization computes it.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, amax_groups: tuple = ()):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, amax_groups: tuple = ()):
        self._tensor = tensor
        self._amax_groups = amax_groups
        # The whole weight's amax, set by precompute_float8_scales for the next all-gathers.
        self._precomputed_amax: torch.Tensor | None = None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        groups = next(t._amax_groups for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls))
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._tensor, groups)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, groups), out) if func in _KEEP_WRAPPER else out

    def __tensor_flatten__(self):
        return ["_tensor"], self._amax_groups

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner_tensors["_tensor"], meta)

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._tensor})"

    def __reduce_ex__(self, protocol):
        # Checkpoints hold the plain weight: loadable with weights_only=True and by runs without this feature.
        return self._tensor.__reduce_ex__(protocol)

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride, module, mp_policy):
        # One tensorwise scale for the whole weight: the max of the shards' amax (a shard may be empty).
        amax = self._precomputed_amax
        if amax is None:
            amax = self._tensor.abs().amax().float() if self._tensor.numel() else torch.zeros((), device=self.device)
            for group in (mesh.get_group(), *self._amax_groups):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        data, inv_scale = quantize(self._tensor, E4M3, amax=amax)
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] < rows:
            # FSDP pads the last shards of an unevenly divided weight; its all-gather inputs must match.
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        # Gloo has no float8 collectives: bytes travel as uint8.
        return (data.view(torch.uint8),), (inv_scale,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None):
        (data,), (inv_scale,) = all_gather_outputs, metadata
        # Power-of-two scales: exact in bf16, and Float8Linear re-quantizes it without further loss.
        weight = (data.view(E4M3).float() * inv_scale).to(param_dtype)
        if out is None:
            return weight, (weight,)
        # The unsharded parameter is refilled in place (under TP its local tensor); autograd must not see it.
        target = out._local_tensor if isinstance(out, DTensor) else out
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
            target.copy_(weight[: target.shape[0]])
        return None


def _all_gather_weight(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, DTensor):
        return Float8AllGatherWeight(weight.data)
    # Tensor parallel: FSDP shards, and calls the hooks of, the DTensor's local tensor.
    local = Float8AllGatherWeight(weight.to_local().detach(), (weight.device_mesh.get_group(),))
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


def enable_float8_all_gather(model: nn.Module) -> int:
    """Wraps the weights of `model`'s Float8Linear modules (plain, or TP DTensors) so FSDP2 all-gathers them in
    float8 (call after tensor parallel, before fully_shard); returns how many, counting those torchao's
    conversion wrapped already."""
    wrapped = 0
    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.weight = nn.Parameter(_all_gather_weight(module.weight), module.weight.requires_grad)
            wrapped += 1
        elif type(getattr(module, "weight", None)).__name__ == "WeightWithDynamicFloat8CastTensor":
            wrapped += 1
    return wrapped


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> None:
    """After the optimizer step: the amax of every weight FSDP all-gathers in float8, in one all-reduce for all of
    them (instead of one per weight and gather). titan's Float8AllGatherWeight and torchao's weights alike."""
    ours = [m.weight for m in model.modules() if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, Float8AllGatherWeight)]
    if ours:
        # DTensor reduces the shards' inf-norms (Partial max) in one all-reduce over every mesh dim that shards.
        amax = torch.stack(torch._foreach_norm(ours, ord=math.inf)).full_tensor().float()
        for i, weight in enumerate(ours):
            weight._local_tensor._precomputed_amax = amax[i]
    elif importlib.util.find_spec("torchao") is not None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8_eligible(fqn: str, linear: nn.Linear, filter_fqns: tuple[str, ...] | list[str] = ("output",)) -> bool:
    """Layers whose name contains one of `filter_fqns` stay high precision (by default the output layer, whose
    logits feed the loss directly), and so do those their model marks `keep_high_precision` (a MoE router's gate:
    float8 logits would flip close top-k choices); small or odd dims cannot use the float8 kernels."""
    if any(f in fqn for f in filter_fqns) or getattr(linear, "keep_high_precision", False):
        return False
    return linear.in_features % FP8_ALIGNMENT == 0 and linear.out_features % FP8_ALIGNMENT == 0


def float8_backend(float8_config, device: torch.device) -> str:
    """`float8.backend` resolved: torchao where its kernels run and it is installed (auto), else titan."""
    if float8_config.backend != "auto":
        return float8_config.backend
    fast = scaled_mm_supported(device, float8_config.recipe)
    return "torchao" if fast and importlib.util.find_spec("torchao") is not None else "titan"


def apply_float8(model: nn.Module, float8_config, device: torch.device | None = None) -> int:
    """Swaps the eligible nn.Linear modules of `model` for a float8 linear (torchao's or ours, see float8_backend)
    in place; returns how many."""
    if not float8_config.enable:
        return 0
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    recipe = float8_config.recipe
    use_scaled_mm = scaled_mm_supported(device, recipe)
    if float8_backend(float8_config, device) == "torchao":
        return apply_torchao_float8(model, float8_config, emulate=not use_scaled_mm)
    swapped, skipped = 0, []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        if not is_float8_eligible(fqn, module, float8_config.filter_fqns):
            skipped.append(fqn)
            continue
        parent_name, _, child = fqn.rpartition(".")
        model.get_submodule(parent_name).register_module(child, Float8Linear.from_linear(module, recipe, use_scaled_mm))
        swapped += 1
    if use_scaled_mm:
        path = "torch._scaled_mm"
    else:
        here = f"sm{''.join(map(str, torch.cuda.get_device_capability(device)))}" if device.type == "cuda" else "cpu"
        path = f"emulation (fast float8 kernels need CUDA sm{'90' if recipe == 'rowwise' else '89'}+, this is {here})"
    logger.info(f"float8 {recipe}: swapped {swapped} linear layers, kept {skipped or 'none'} in high precision; "
                f"matmuls via {path}")
    return swapped


def torchao_config(recipe: str, emulate: bool, fsdp_all_gather: bool = False):
    """torchao's Float8LinearConfig for `recipe`, with scales rounded down to powers of two as ours are (its
    rowwise recipe does that already), so both give the same numbers."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, round_scales_to_power_of_2=True,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def apply_torchao_float8(model: nn.Module, float8_config, emulate: bool) -> int:
    """torchao's convert_to_float8_training on the layers is_float8_eligible picks; returns how many."""
    if importlib.util.find_spec("torchao") is None:
        raise UserError("float8.backend torchao needs torchao: pip install 'titan-suite[float8]' (or pass "
                        "--float8.backend titan)")
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    if float8_config.enable_fsdp_float8_all_gather and emulate:
        raise UserError("float8.backend torchao all-gathers float8 tensors, which gloo cannot send: on a CPU pass "
                        "--float8.backend titan (or drop --float8.enable_fsdp_float8_all_gather)")
    config = torchao_config(float8_config.recipe, emulate, float8_config.enable_fsdp_float8_all_gather)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: is_float8_eligible(fqn, m, float8_config.filter_fqns))
    swapped = sum(isinstance(m, TorchaoFloat8Linear) for m in model.modules())
    how = "emulated (no float8 kernels on this device)" if emulate else "torch._scaled_mm"
    logger.info(f"float8 {float8_config.recipe}: torchao swapped {swapped} linear layers; matmuls {how}")
    return swapped
