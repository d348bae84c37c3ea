"""Function-preserving morphisms (Net2Net-style) and `hatch`, which composes them to turn a mother into a member.

Every morphism returns a new Net and leaves its parent untouched. In eval mode the child computes the parent's
function up to float rounding; widening and kernel growth are exact in train mode too (replicated channels have
the replicated batch statistics), and so are new residual blocks (their last BatchNorm starts at zero).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from morphens.arch import MLP, VGG, Arch, Conv, ResNet, Stage, describe
from morphens.models import BN_EPS, ConvBN, Net

BN = ("weight", "bias", "running_mean", "running_var")
State = dict[str, torch.Tensor]


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


def _widened(arch: Arch, state: State, key: tuple, width: int, gen: torch.Generator | None) -> tuple[Arch, State]:
    table = units(arch)
    if key not in table:
        raise ValueError(f"widen: {describe(arch)} has no unit {key}; it has {sorted(table)}")
    unit = table[key]
    if width < unit.width:
        raise ValueError(f"widen {key}: cannot narrow {unit.width} -> {width} channels (morphisms only grow)")
    source = torch.cat([torch.arange(unit.width), torch.randint(unit.width, (width - unit.width,), generator=gen)])
    replicas = torch.bincount(source, minlength=unit.width)[source]
    # A name missing from `state` belongs to a residual block that hatch has added but not yet initialized.
    new = {name: state[name].index_select(0, source) for name in unit.rows if name in state}
    for name in (n for n in unit.cols if n in state):
        w = state[name].index_select(1, source)
        new[name] = w / replicas.to(w).view(1, -1, *[1] * (w.dim() - 2))
    return _with_width(arch, key, width), {**state, **new}


def widen(parent: Net, key: tuple, width: int, gen: torch.Generator | None = None) -> Net:
    """Net2Wider: new channels replicate random existing ones; consumers divide their weights by replica counts."""
    return _child(parent, *_widened(parent.arch, parent.state_dict(), key, width, gen), gen)


class _Seen(Exception):
    """Ends a forward pass that need not go on."""


@torch.no_grad()
def _channel_stats(parent: Net, paths: list[str], calib: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-channel mean and (biased) variance of each submodule in `paths` on `calib`, in train mode as training
    will see it (train mode updates BatchNorm statistics: those of copies, so `parent` keeps its own)."""
    stats = {}

    def record(path: str, out: torch.Tensor) -> None:
        dims = [d for d in range(out.dim()) if d != 1]
        stats[path] = out.mean(dims), out.var(dims, unbiased=False)
        if len(stats) == len(paths):
            raise _Seen()  # the layers after the last of `paths` would only cost time

    def hook(path: str):
        module = parent.get_submodule(path)
        if isinstance(module, ConvBN):  # its output before its pooling (run under no_grad: the torch ops)
            return module.pool.register_forward_pre_hook(lambda m, args, path=path: record(path, args[0]))
        return module.register_forward_hook(lambda m, i, out, path=path: record(path, out))

    hooks = [hook(path) for path in paths]
    was_training = parent.training
    parent.train()
    weights = {**dict(parent.named_parameters()), **{k: v.clone() for k, v in parent.named_buffers()}}
    try:
        torch.func.functional_call(parent, weights, (calib,))
    except _Seen:
        pass
    finally:
        for hook in hooks:
            hook.remove()
        parent.train(was_training)
    return stats


def _producer(arch: Arch, block: int) -> str:
    """The layer whose output an identity layer appended to `block` (VGG block or MLP's hidden stack) takes in."""
    return f"layers.{block}.{len(arch.blocks[block]) - 1}" if isinstance(arch, VGG) else \
        f"layers.{len(arch.hidden) - 1}"


def _check_block(arch: Arch, block: int) -> None:
    count = len(arch.blocks if isinstance(arch, VGG) else arch.stages if isinstance(arch, ResNet) else [0])
    if not 0 <= block < count:
        raise ValueError(f"deepen: block {block} out of range for {describe(arch)} ({count} blocks)")


def _deepened(arch: Arch, state: State, block: int, kernel: int, inner: int | None,
              stats: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[Arch, State]:
    """deepen on (arch, state); `stats` are the producer's train-mode channel statistics (None: mean 0, var 1).
    A new residual block gets only its zero last BatchNorm: its other weights are initialized when built."""
    _check_block(arch, block)
    ref = state["head.weight"]
    if isinstance(arch, ResNet):
        stage = arch.stages[block]
        stages = list(arch.stages)
        stages[block] = Stage(stage.width, (*stage.blocks, inner or stage.width))
        name = f"layers.{block}.blocks.{len(stage.blocks)}.bn2"
        zero = ref.new_zeros(stage.width)
        return replace(arch, stages=tuple(stages)), {**state, f"{name}.weight": zero, f"{name}.bias": zero}
    if isinstance(arch, VGG):
        last = arch.blocks[block][-1]
        blocks = list(arch.blocks)
        blocks[block] = (*blocks[block], Conv(last.width, kernel))
        child_arch, width = replace(arch, blocks=tuple(blocks)), last.width
        name = f"layers.{block}.{len(arch.blocks[block])}"
        eye = ref.new_zeros(width, width, kernel, kernel)
        eye[torch.arange(width), torch.arange(width), kernel // 2, kernel // 2] = 1
        new = {f"{name}.conv.weight": eye}
    else:
        width = arch.hidden[-1]
        child_arch, name = replace(arch, hidden=(*arch.hidden, width)), f"layers.{len(arch.hidden)}"
        new = {f"{name}.fc.weight": torch.eye(width, dtype=ref.dtype, device=ref.device)}
    # In the parent's dtype throughout: BatchNorm divides by sqrt(var + eps) in that dtype, so a weight of
    # sqrt(1 + eps) rounded in float32 would leave a float64 hatch off by ~1e-8 per inserted layer.
    mean, var = stats if stats is not None else (ref.new_zeros(width), ref.new_ones(width))
    new |= {f"{name}.bn.running_mean": mean, f"{name}.bn.running_var": var,
            f"{name}.bn.weight": (var + BN_EPS).sqrt(), f"{name}.bn.bias": mean,
            f"{name}.bn.num_batches_tracked": torch.zeros((), dtype=torch.long)}  # as a fresh BatchNorm's
    return child_arch, {**state, **new}


def deepen(parent: Net, block: int = 0, kernel: int = 3, inner: int | None = None,
           calib: torch.Tensor | None = None, gen: torch.Generator | None = None) -> Net:
    """Net2Deeper: appends an identity layer to VGG block `block` (with `kernel`) or the MLP's hidden layers, or a
    residual block of inner width `inner` (default: the stage width) to ResNet stage `block`.

    The new BatchNorm is the identity in eval mode. With a calibration batch it also takes the train-mode batch
    statistics of its input, so that in train mode it is the identity on that batch and close to it on others.
    """
    _check_block(parent.arch, block)  # before the statistics, which look the block up
    stats = None
    if calib is not None and not isinstance(parent.arch, ResNet):
        producer = _producer(parent.arch, block)
        stats = _channel_stats(parent, [producer], calib)[producer]
    return _child(parent, *_deepened(parent.arch, parent.state_dict(), block, kernel, inner, stats), gen)


def _kernel_grown(arch: Arch, state: State, block: int, layer: int, kernel: int) -> tuple[Arch, State]:
    if not isinstance(arch, VGG):
        raise ValueError(f"grow_kernel: only VGG-style nets have variable kernels, not {arch.family}")
    old = arch.blocks[block][layer]
    if kernel < old.kernel or (kernel - old.kernel) % 2:
        raise ValueError(f"grow_kernel: cannot go from kernel {old.kernel} to {kernel} (needs a larger odd size)")
    blocks = [list(b) for b in arch.blocks]
    blocks[block][layer] = Conv(old.width, kernel)
    name = f"layers.{block}.{layer}.conv.weight"
    pad = (kernel - old.kernel) // 2
    return replace(arch, blocks=tuple(map(tuple, blocks))), {**state, name: F.pad(state[name], (pad,) * 4)}


def grow_kernel(parent: Net, block: int, layer: int, kernel: int) -> Net:
    """Zero-pads a VGG conv's kernel to `kernel` (padding grows with it, so outputs are unchanged)."""
    return _child(parent, *_kernel_grown(parent.arch, parent.state_dict(), block, layer, kernel), None)


def _noise_scale(w: torch.Tensor) -> torch.Tensor:
    """The scale of a weight tensor's noise: its std, or its RMS where the std is undefined (one element) or zero
    (all replicas of one value, exactly the symmetry that the noise must break)."""
    std = w.std() if w.numel() > 1 else w.new_zeros(())
    return std if std > 0 else w.pow(2).mean().sqrt()


def add_noise(parent: Net, amount: float, calib: torch.Tensor, gen: torch.Generator | None = None,
              tolerance: float = 0.02) -> Net:
    """Symmetry breaking: adds Gaussian noise to every conv/linear weight (each scaled by `_noise_scale` of it),
    sized so the eval-mode logits on `calib` move by `amount` relative RMS (within `tolerance` of it)."""
    if amount < 0:
        raise ValueError(f"noise: amount must be >= 0, got {amount}")
    return _noised(_child(parent, parent.arch, parent.state_dict(), None), amount, calib, gen, tolerance)


@torch.no_grad()
def _noised(net: Net, amount: float, calib: torch.Tensor, gen: torch.Generator | None,
            tolerance: float = 0.02) -> Net:
    """add_noise in place, on a net that nothing else holds."""
    state = {k: v.clone() for k, v in net.state_dict().items()}
    names = [n for n, p in net.named_parameters() if p.dim() > 1]
    direction = {n: torch.randn(state[n].shape, generator=gen).to(state[n]) * _noise_scale(state[n]) for n in names}
    training = net.training
    reference = net.eval()(calib)

    def moved(scale: float) -> float:
        net.load_state_dict({**state, **{n: state[n] + scale * direction[n] for n in names}})
        return float((net(calib) - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt())

    scale = amount
    for _ in range(8):  # logits move almost linearly with a small scale: rescaling converges in a few steps
        got = moved(scale)
        if amount == 0 or abs(got / amount - 1) <= tolerance:
            break
        scale *= amount / max(got, 1e-12)
    return net.train(training)


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


def _grown(arch: Arch, state: State, key: tuple, width: int, gen: torch.Generator) -> tuple[Arch, State]:
    return (arch, state) if units(arch)[key].width == width else _widened(arch, state, key, width, gen)


def _identity_stats(mother: Net, member: Arch, calib: torch.Tensor | None) -> dict[int, tuple[torch.Tensor, ...]]:
    """By block: the train-mode statistics on `calib` of the mother's layer that `member`'s identity layers follow
    (one forward pass of the mother; none without `calib`)."""
    ours, theirs = ((mother.arch.blocks, member.blocks) if isinstance(member, VGG)
                    else ((mother.arch.hidden,), (member.hidden,)))
    deeper = {b: _producer(mother.arch, b) for b, (m, t) in enumerate(zip(ours, theirs)) if len(t) > len(m)}
    if calib is None or not deeper:
        return {}
    stats = _channel_stats(mother, list(deeper.values()), calib)
    return {b: stats[path] for b, path in deeper.items()}


def hatch(mother: Net, member: Arch, noise: float = 0.0, seed: int = 0,
          calib: torch.Tensor | None = None) -> Net:
    """Grows `mother` into `member`: deepen, grow kernels, widen, then optional noise (needs `calib`).

    The morphisms compose on state dicts and the member is built once. Identity layers are calibrated with the
    mother's statistics at their place: every morphism before them keeps those exactly in train mode on `calib`.
    """
    check_reachable(mother.arch, member)
    if noise and calib is None:
        raise ValueError("hatch: noise needs a calibration batch (calib) to size it")
    gen = torch.Generator().manual_seed(seed)
    arch, state = mother.arch, mother.state_dict()
    stats = {} if isinstance(member, ResNet) else _identity_stats(mother, member, calib)
    if isinstance(member, ResNet):
        for s, stage in enumerate(member.stages):
            for inner in stage.blocks[len(arch.stages[s].blocks):]:
                arch, state = _deepened(arch, state, s, 3, inner, None)
            arch, state = _grown(arch, state, ("stage", s), stage.width, gen)
            for j, inner in enumerate(stage.blocks):
                arch, state = _grown(arch, state, ("inner", s, j), inner, gen)
    elif isinstance(member, VGG):
        for b, block in enumerate(member.blocks):
            for conv in block[len(arch.blocks[b]):]:
                arch, state = _deepened(arch, state, b, conv.kernel, None, stats.get(b))
            for i, conv in enumerate(block):
                if conv.kernel != arch.blocks[b][i].kernel:
                    arch, state = _kernel_grown(arch, state, b, i, conv.kernel)
                arch, state = _grown(arch, state, ("conv", b, i), conv.width, gen)
    else:
        for _ in member.hidden[len(arch.hidden):]:
            arch, state = _deepened(arch, state, 0, 3, None, stats.get(0))
        for i, width in enumerate(member.hidden):
            arch, state = _grown(arch, state, ("hidden", i), width, gen)
    net = _child(mother, arch, state, gen)  # copies: the member shares no tensor with its mother
    return _noised(net, noise, calib, gen) if noise else net

