"""MotherNet construction per cluster, and clustering an ensemble into g clusters.

Mother rule (the tight minimum, see morph.check_reachable): per block the fewest layers of any member; per layer
the fewest channels and the smallest kernel of any member at that position. The last mother layer of a VGG block
(or of an MLP) also takes the fewest channels of every member layer after it, because those layers hatch as
identity copies of it. Every member is then reachable, and growing any mother dimension by one step would make
some member unreachable.

Clustering rule: members that differ in family, input, classes or pooling levels can never share a mother, so
they form separate groups (g must be at least their number). The remaining clusters go one at a time to the group
with the most members per cluster; each group is sorted by forward FLOPs and cut into that many contiguous
chunks of near-equal count, so similar-sized members share a mother and it stays large. g = 1 is the cheapest
setting; g = K trains every member independently (each is its own mother).
"""

from __future__ import annotations

from collections.abc import Sequence

from morphens.arch import MLP, VGG, Arch, Conv, ResNet, Stage, describe, forward_flops


def compat_key(arch: Arch) -> tuple:
    """Members with equal keys can share a mother."""
    levels = len(arch.blocks if isinstance(arch, VGG) else arch.stages if isinstance(arch, ResNet) else [0])
    return arch.family, tuple(arch.in_shape), arch.num_classes, levels


def _mother_block(blocks: list[tuple[Conv, ...]]) -> tuple[Conv, ...]:
    depth = min(len(block) for block in blocks)
    layers = [Conv(min(b[i].width for b in blocks), min(b[i].kernel for b in blocks)) for i in range(depth)]
    last = min(c.width for b in blocks for c in b[depth - 1:])
    layers[-1] = Conv(last, layers[-1].kernel)
    return tuple(layers)


def mother_of(members: Sequence[Arch]) -> Arch:
    """The largest net from which growth alone reaches every member."""
    if not members:
        raise ValueError("mother_of: needs at least one member")
    first = members[0]
    for m in members[1:]:
        if compat_key(m) != compat_key(first):
            raise ValueError(f"incompatible members {describe(first)} and {describe(m)}: family, input/output "
                             "shapes and pooling levels must match to share a mother")
    if isinstance(first, VGG):
        blocks = tuple(_mother_block([m.blocks[b] for m in members]) for b in range(len(first.blocks)))
        return VGG(first.in_shape, first.num_classes, blocks)
    if isinstance(first, MLP):
        hidden = _mother_block([tuple(Conv(w) for w in m.hidden) for m in members])
        return MLP(first.in_shape, first.num_classes, tuple(c.width for c in hidden))
    stages = []
    for s in range(len(first.stages)):
        mine = [m.stages[s] for m in members]
        depth = min(len(st.blocks) for st in mine)
        inners = tuple(min(st.blocks[j] for st in mine) for j in range(depth))
        stages.append(Stage(min(st.width for st in mine), inners))
    return ResNet(first.in_shape, first.num_classes, tuple(stages))


def cluster(members: Sequence[Arch], g: int) -> list[list[int]]:
    """Splits member indices into g clusters by the rule in the module docstring."""
    k = len(members)
    if not 1 <= g <= k:
        raise ValueError(f"clusters: g={g} must be between 1 and the ensemble size {k}")
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(members):
        groups.setdefault(compat_key(m), []).append(i)
    if g < len(groups):
        raise ValueError(f"clusters: g={g} but the members form {len(groups)} groups that cannot share a mother "
                         "(different family, input, classes or pooling levels); use g >= that")
    share = {key: 1 for key in groups}
    for _ in range(g - len(groups)):
        key = max((key for key in groups if share[key] < len(groups[key])),
                  key=lambda key: len(groups[key]) / share[key])
        share[key] += 1
    clusters = []
    for key, idx in groups.items():
        idx = sorted(idx, key=lambda i: forward_flops(members[i]))
        n, parts = len(idx), share[key]
        bounds = [n * p // parts for p in range(parts + 1)]
        clusters += [sorted(idx[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
    return sorted(clusters)
