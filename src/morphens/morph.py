"""Function-preserving morphisms (Net2Net-style) and `hatch`, which composes them to turn a mother into a member.

Every morphism returns a new Net and leaves its parent untouched. In eval mode the child computes the parent's
function up to float rounding; widening and kernel growth are exact in train mode too (replicated channels have
the replicated batch statistics), and so are new residual blocks (their last BatchNorm starts at zero).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from morphens.arch import MLP, VGG, Arch, Conv, ResNet, Stage, describe
from morphens.models import Net

BN = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class Unit:
    """A group of channels that must be widened together."""

    width: int
    rows: tuple[str, ...]
    """Tensors whose dim 0 indexes the channels (producing weights, BatchNorm parameters and statistics)."""
    cols: tuple[str, ...]
    """Weights whose dim 1 indexes the channels (consumers: replicas split the original weight)."""


def _bn(prefix: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{name}" for name in BN)


def units(arch: Arch) -> dict[tuple, Unit]:
    """Widenable channel groups, keyed ("conv", block, layer), ("hidden", layer), ("stage", s) or ("inner", s, j)."""
    out: dict[tuple, Unit] = {}
    if isinstance(arch, VGG):
        names = [[f"layers.{b}.{i}" for i in range(len(block))] for b, block in enumerate(arch.blocks)]
        flat = [(b, i, name) for b, block in enumerate(names) for i, name in enumerate(block)]
        for (b, i, name), nxt in zip(flat, [f"{n}.conv.weight" for _, _, n in flat[1:]] + ["head.weight"]):
            out[("conv", b, i)] = Unit(arch.blocks[b][i].width, (f"{name}.conv.weight", *_bn(f"{name}.bn")), (nxt,))
    elif isinstance(arch, MLP):
        for i, width in enumerate(arch.hidden):
            nxt = f"layers.{i + 1}.fc.weight" if i + 1 < len(arch.hidden) else "head.weight"
            out[("hidden", i)] = Unit(width, (f"layers.{i}.fc.weight", *_bn(f"layers.{i}.bn")), (nxt,))
    else:
        for s, stage in enumerate(arch.stages):
            blocks = [f"layers.{s}.blocks.{j}" for j in range(len(stage.blocks))]
            nxt = f"layers.{s + 1}.transition.conv.weight" if s + 1 < len(arch.stages) else "head.weight"
            rows = [f"layers.{s}.transition.conv.weight", *_bn(f"layers.{s}.transition.bn")]
            for block in blocks:
                rows += [f"{block}.conv2.weight", *_bn(f"{block}.bn2")]
            out[("stage", s)] = Unit(stage.width, tuple(rows), (*(f"{b}.conv1.weight" for b in blocks), nxt))
            for j, (block, inner) in enumerate(zip(blocks, stage.blocks)):
                out[("inner", s, j)] = Unit(inner, (f"{block}.conv1.weight", *_bn(f"{block}.bn1")),
                                            (f"{block}.conv2.weight",))
    return out


def _with_width(arch: Arch, key: tuple, width: int) -> Arch:
    if key[0] == "conv":
        _, b, i = key
        blocks = [list(block) for block in arch.blocks]
        blocks[b][i] = replace(blocks[b][i], width=width)
        return replace(arch, blocks=tuple(map(tuple, blocks)))
    if key[0] == "hidden":
        hidden = list(arch.hidden)
        hidden[key[1]] = width
        return replace(arch, hidden=tuple(hidden))
    stages = list(arch.stages)
    stage = stages[key[1]]
    if key[0] == "stage":
        stages[key[1]] = replace(stage, width=width)
    else:
        inners = list(stage.blocks)
        inners[key[2]] = width
        stages[key[1]] = replace(stage, blocks=tuple(inners))
    return replace(arch, stages=tuple(stages))


def _child(parent: Net, arch: Arch, state: dict[str, torch.Tensor], gen: torch.Generator | None) -> Net:
    """A net of `arch`: fresh (seeded) weights wherever `state` says nothing, `state` everywhere else."""
    weight = next(parent.parameters())
    with torch.device("meta"):
        child = Net(arch)
    seed = int(torch.randint(2**62, (), generator=gen)) if gen is not None else 0  # drawn either way: same stream
    keys = child.state_dict().keys()
    if keys <= state.keys():
        # Nothing left to initialize (every morphism but a ResNet deepen): skip building, seeding and
        # initializing weights only to overwrite them, the bulk of a hatch's time. Copies, so that training the
        # child never writes into the parent's tensors.
        dtype = lambda t: weight.dtype if t.is_floating_point() else t.dtype
        child.load_state_dict({k: state[k].to(weight.device, dtype(state[k]), copy=True) for k in keys}, assign=True)
        return child.train(parent.training)
    child = Net(arch).to(device=weight.device, dtype=weight.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        child.init_weights()
    child.load_state_dict({**child.state_dict(), **state})
    return child.train(parent.training)


def widen(parent: Net, key: tuple, width: int, gen: torch.Generator | None = None) -> Net:
    """Net2Wider: new channels replicate random existing ones; consumers divide their weights by replica counts."""
    table = units(parent.arch)
    if key not in table:
        raise ValueError(f"widen: {describe(parent.arch)} has no unit {key}; it has {sorted(table)}")
    unit = table[key]
    if width < unit.width:
        raise ValueError(f"widen {key}: cannot narrow {unit.width} -> {width} channels (morphisms only grow)")
    source = torch.cat([torch.arange(unit.width), torch.randint(unit.width, (width - unit.width,), generator=gen)])
    replicas = torch.bincount(source, minlength=unit.width)[source]
    state = parent.state_dict()
    new = {name: state[name].index_select(0, source) for name in unit.rows}
    for name in unit.cols:
        w = state[name].index_select(1, source)
        new[name] = w / replicas.to(w).view(1, -1, *[1] * (w.dim() - 2))
    return _child(parent, _with_width(parent.arch, key, width), {**state, **new}, gen)


class _Seen(Exception):
    """Carries a submodule's output out of a forward pass that need not go on."""


@torch.no_grad()
def _channel_stats(parent: Net, path: str, calib: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance of submodule `path`'s output on `calib`, in train mode as training
    will see it (on a copy: train mode updates BatchNorm statistics)."""
    model = copy.deepcopy(parent).train()

    def stop(module: torch.nn.Module, inputs: tuple, out: torch.Tensor) -> None:
        raise _Seen(out)  # the layers after `path` would only cost time

    model.get_submodule(path).register_forward_hook(stop)
    try:
        model(calib)
    except _Seen as seen:
        out = seen.args[0]
    dims = [d for d in range(out.dim()) if d != 1]
    return out.mean(dims), out.var(dims, unbiased=False)


def deepen(parent: Net, block: int = 0, kernel: int = 3, inner: int | None = None,
           calib: torch.Tensor | None = None, gen: torch.Generator | None = None) -> Net:
    """Net2Deeper: appends an identity layer to VGG block `block` (with `kernel`) or the MLP's hidden layers, or a
    residual block of inner width `inner` (default: the stage width) to ResNet stage `block`.

    The new BatchNorm is the identity in eval mode. With a calibration batch it also takes the train-mode batch
    statistics of its input, so that in train mode it is the identity on that batch and close to it on others.
    """
    arch = parent.arch
    state = parent.state_dict()
    ref = state["head.weight"]
    count = len(arch.blocks if isinstance(arch, VGG) else arch.stages if isinstance(arch, ResNet) else [0])
    if not 0 <= block < count:
        raise ValueError(f"deepen: block {block} out of range for {describe(arch)} ({count} blocks)")
    if isinstance(arch, ResNet):
        stage = arch.stages[block]
        stages = list(arch.stages)
        stages[block] = Stage(stage.width, (*stage.blocks, inner or stage.width))
        name = f"layers.{block}.blocks.{len(stage.blocks)}.bn2"
        zero = ref.new_zeros(stage.width)
        return _child(parent, replace(arch, stages=tuple(stages)), {**state, f"{name}.weight": zero,
                                                                  f"{name}.bias": zero}, gen)
    if isinstance(arch, VGG):
        last = arch.blocks[block][-1]
        blocks = list(arch.blocks)
        blocks[block] = (*blocks[block], Conv(last.width, kernel))
        child_arch, width = replace(arch, blocks=tuple(blocks)), last.width
        name, producer = f"layers.{block}.{len(arch.blocks[block])}", f"layers.{block}.{len(arch.blocks[block]) - 1}"
        eye = ref.new_zeros(width, width, kernel, kernel)
        eye[torch.arange(width), torch.arange(width), kernel // 2, kernel // 2] = 1
        new = {f"{name}.conv.weight": eye}
    else:
        width = arch.hidden[-1]
        child_arch, name = replace(arch, hidden=(*arch.hidden, width)), f"layers.{len(arch.hidden)}"
        producer = f"layers.{len(arch.hidden) - 1}"
        new = {f"{name}.fc.weight": torch.eye(width, dtype=ref.dtype, device=ref.device)}
    # In the parent's dtype throughout: BatchNorm divides by sqrt(var + eps) in that dtype, so a weight of
    # sqrt(1 + eps) rounded in float32 would leave a float64 hatch off by ~1e-8 per inserted layer.
    mean, var = (_channel_stats(parent, producer, calib) if calib is not None
                 else (ref.new_zeros(width), ref.new_ones(width)))
    eps = parent.get_submodule(producer).bn.eps
    new |= {f"{name}.bn.running_mean": mean, f"{name}.bn.running_var": var,
            f"{name}.bn.weight": (var + eps).sqrt(), f"{name}.bn.bias": mean,
            f"{name}.bn.num_batches_tracked": torch.zeros((), dtype=torch.long)}  # as a fresh BatchNorm's
    return _child(parent, child_arch, {**state, **new}, gen)


def grow_kernel(parent: Net, block: int, layer: int, kernel: int) -> Net:
    """Zero-pads a VGG conv's kernel to `kernel` (padding grows with it, so outputs are unchanged)."""
    arch = parent.arch
    if not isinstance(arch, VGG):
        raise ValueError(f"grow_kernel: only VGG-style nets have variable kernels, not {arch.family}")
    old = arch.blocks[block][layer]
    if kernel < old.kernel or (kernel - old.kernel) % 2:
        raise ValueError(f"grow_kernel: cannot go from kernel {old.kernel} to {kernel} (needs a larger odd size)")
    blocks = [list(b) for b in arch.blocks]
    blocks[block][layer] = Conv(old.width, kernel)
    name = f"layers.{block}.{layer}.conv.weight"
    state = parent.state_dict()
    pad = (kernel - old.kernel) // 2
    grown = F.pad(state[name], (pad, pad, pad, pad))
    return _child(parent, replace(arch, blocks=tuple(map(tuple, blocks))), {**state, name: grown}, None)


def _spread(w: torch.Tensor) -> torch.Tensor:
    """The scale of a weight tensor's noise: its std, or its RMS where the std is undefined (one element) or zero
    (all replicas of one value, exactly the symmetry that the noise must break)."""
    std = w.std() if w.numel() > 1 else w.new_zeros(())
    return std if std > 0 else w.pow(2).mean().sqrt()


@torch.no_grad()
def add_noise(parent: Net, amount: float, calib: torch.Tensor, gen: torch.Generator | None = None,
              tolerance: float = 0.02) -> Net:
    """Symmetry breaking: adds Gaussian noise to every conv/linear weight (each scaled by `_spread` of it),
    sized so the eval-mode logits on `calib` move by `amount` relative RMS (within `tolerance` of it)."""
    if amount < 0:
        raise ValueError(f"noise: amount must be >= 0, got {amount}")
    state = parent.state_dict()
    names = [n for n, p in parent.named_parameters() if p.dim() > 1]
    direction = {n: torch.randn(state[n].shape, generator=gen).to(state[n]) * _spread(state[n]) for n in names}
    child = _child(parent, parent.arch, state, None).eval()
    reference = child(calib)

    def moved(scale: float) -> float:
        child.load_state_dict({**state, **{n: state[n] + scale * direction[n] for n in names}})
        return float((child(calib) - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())

    scale = amount
    for _ in range(8):  # logits move almost linearly with a small scale: rescaling converges in a few steps
        got = moved(scale)
        if amount == 0 or abs(got / amount - 1) <= tolerance:
            break
        scale *= amount / max(got, 1e-12)
    return child.train(parent.training)


def check_reachable(mother: Arch, member: Arch) -> None:
    """Raises ValueError (one line, naming the first obstacle) unless growth alone turns `mother` into `member`.

    Rule: same family, input and classes and pooling levels; per block at least as many layers; per layer at
    least as many channels and as large a kernel. Extra VGG/MLP layers are identities of the block's last mother
    layer, so they need at least its width; extra residual blocks start at zero, so they may have any width.
    """
    where = f"{describe(member)} from mother {describe(mother)}"
    if member.family != mother.family:
        raise ValueError(f"cannot hatch {where}: different families")
    if (member.in_shape, member.num_classes) != (mother.in_shape, mother.num_classes):
        raise ValueError(f"cannot hatch {where}: input/output shapes differ "
                         f"({member.in_shape}->{member.num_classes} vs {mother.in_shape}->{mother.num_classes})")
    if isinstance(member, ResNet):
        if len(member.stages) != len(mother.stages):
            raise ValueError(f"cannot hatch {where}: different numbers of stages")
        for s, (ms, ts) in enumerate(zip(mother.stages, member.stages)):
            if ts.width < ms.width or len(ts.blocks) < len(ms.blocks):
                raise ValueError(f"cannot hatch {where}: stage {s} is narrower or shallower than the mother's")
            if any(t < m for m, t in zip(ms.blocks, ts.blocks)):
                raise ValueError(f"cannot hatch {where}: a residual block of stage {s} is narrower than the mother's")
        return
    if isinstance(member, MLP):
        if len(member.hidden) < len(mother.hidden):
            raise ValueError(f"cannot hatch {where}: fewer hidden layers than the mother's")
        for i, width in enumerate(member.hidden):
            needs = mother.hidden[min(i, len(mother.hidden) - 1)]
            if width < needs:
                raise ValueError(f"cannot hatch {where}: hidden layer {i} is narrower than the mother's "
                                 f"(needs width >= {needs})")
        return
    if len(member.blocks) != len(mother.blocks):
        raise ValueError(f"cannot hatch {where}: different numbers of blocks")
    for b, (mb, tb) in enumerate(zip(mother.blocks, member.blocks)):
        if len(tb) < len(mb):
            raise ValueError(f"cannot hatch {where}: block {b} has fewer layers than the mother's")
        for i, t in enumerate(tb):
            m = mb[min(i, len(mb) - 1)]
            if t.width < m.width or (i < len(mb) and t.kernel < m.kernel):
                raise ValueError(f"cannot hatch {where}: layer {i} of block {b} is smaller than the mother's "
                                 f"(needs width >= {m.width}" + (f", kernel >= {m.kernel})" if i < len(mb) else ")"))


def _grown(net: Net, key: tuple, width: int, gen: torch.Generator) -> Net:
    return net if units(net.arch)[key].width == width else widen(net, key, width, gen)


def hatch(mother: Net, member: Arch, noise: float = 0.0, seed: int = 0,
          calib: torch.Tensor | None = None) -> Net:
    """Grows `mother` into `member`: deepen, grow kernels, widen, then optional noise (needs `calib`)."""
    check_reachable(mother.arch, member)
    if noise and calib is None:
        raise ValueError("hatch: noise needs a calibration batch (calib) to size it")
    gen = torch.Generator().manual_seed(seed)
    net = mother
    if isinstance(member, ResNet):
        for s, stage in enumerate(member.stages):
            for inner in stage.blocks[len(net.arch.stages[s].blocks):]:
                net = deepen(net, s, inner=inner, gen=gen)
            net = _grown(net, ("stage", s), stage.width, gen)
            for j, inner in enumerate(stage.blocks):
                net = _grown(net, ("inner", s, j), inner, gen)
    elif isinstance(member, VGG):
        for b, block in enumerate(member.blocks):
            for conv in block[len(net.arch.blocks[b]):]:
                net = deepen(net, b, kernel=conv.kernel, calib=calib, gen=gen)
            for i, conv in enumerate(block):
                if conv.kernel != net.arch.blocks[b][i].kernel:
                    net = grow_kernel(net, b, i, conv.kernel)
                net = _grown(net, ("conv", b, i), conv.width, gen)
    else:
        for _ in member.hidden[len(net.arch.hidden):]:
            net = deepen(net, calib=calib, gen=gen)
        for i, width in enumerate(member.hidden):
            net = _grown(net, ("hidden", i), width, gen)
    if net is mother:  # the member is the mother itself: still hand back a copy
        net = _child(mother, member, mother.state_dict(), None)
    return add_noise(net, noise, calib, gen) if noise else net
