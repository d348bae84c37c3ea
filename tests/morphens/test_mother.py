from dataclasses import replace

import pytest

from morphens.arch import MLP, VGG, Conv, Generator, ResNet, Stage, describe
from morphens.morph import check_reachable
from morphens.mother import cluster, mother_of

SHAPE = (1, 16, 16)


def grown_by_one_step(arch):
    """Every variant of `arch` with one dimension grown by one step (width +1, kernel +2, one more layer)."""
    out = []
    if isinstance(arch, VGG):
        for b, block in enumerate(arch.blocks):
            for i, conv in enumerate(block):
                for bigger in (Conv(conv.width + 1, conv.kernel), Conv(conv.width, conv.kernel + 2)):
                    blocks = [list(x) for x in arch.blocks]
                    blocks[b][i] = bigger
                    out.append(replace(arch, blocks=tuple(map(tuple, blocks))))
            blocks = list(arch.blocks)
            blocks[b] = (*block, block[-1])
            out.append(replace(arch, blocks=tuple(blocks)))
    elif isinstance(arch, ResNet):
        for s, stage in enumerate(arch.stages):
            variants = [replace(stage, width=stage.width + 1), replace(stage, blocks=(*stage.blocks, 1))]
            variants += [replace(stage, blocks=stage.blocks[:j] + (w + 1,) + stage.blocks[j + 1:])
                         for j, w in enumerate(stage.blocks)]
            for v in variants:
                stages = list(arch.stages)
                stages[s] = v
                out.append(replace(arch, stages=tuple(stages)))
    else:
        for i, w in enumerate(arch.hidden):
            out.append(replace(arch, hidden=arch.hidden[:i] + (w + 1,) + arch.hidden[i + 1:]))
        out.append(replace(arch, hidden=(*arch.hidden, arch.hidden[-1])))
    return out


def reachable(mother, member):
    try:
        check_reachable(mother, member)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("family", ["vgg", "resnet", "mlp"])
@pytest.mark.parametrize("seed", range(25))
def test_mother_is_the_tight_minimum(family, seed):
    members = Generator(family, blocks=3, width=4, max_depth=3, kernels=(3, 5, 7)).sample(1 + seed % 5, SHAPE, 10,
                                                                                        seed)
    mother = mother_of(members)
    for member in members:
        check_reachable(mother, member)
    for bigger in grown_by_one_step(mother):
        assert not all(reachable(bigger, m) for m in members), f"{describe(bigger)} still reaches every member"


def test_mother_rule_on_a_hand_example():
    members = [
        VGG(SHAPE, 10, ((Conv(8, 5), Conv(6, 3)), (Conv(32, 7),))),
        VGG(SHAPE, 10, ((Conv(12, 3),), (Conv(24, 5), Conv(20, 3), Conv(40, 3)))),
    ]
    # Per block the fewer layers; the last mother layer is no wider than any member layer hatched as its copy.
    assert mother_of(members) == VGG(SHAPE, 10, ((Conv(6, 3),), (Conv(20, 5),)))
    resnets = [ResNet(SHAPE, 10, (Stage(8, (4, 16)), Stage(16, ()))),
               ResNet(SHAPE, 10, (Stage(6, (8,)), Stage(32, (2,))))]
    assert mother_of(resnets) == ResNet(SHAPE, 10, (Stage(6, (4,)), Stage(16, ())))
    assert mother_of([MLP(SHAPE, 10, (64, 32)), MLP(SHAPE, 10, (48,))]) == MLP(SHAPE, 10, (32,))


def test_mother_of_one_member_is_the_member():
    member = Generator("resnet").sample(1, SHAPE, 10, 3)[0]
    assert mother_of([member]) == member


def test_incompatible_members_have_no_mother():
    vgg = VGG(SHAPE, 10, ((Conv(8),), (Conv(8),)))
    with pytest.raises(ValueError, match="incompatible members"):
        mother_of([vgg, VGG(SHAPE, 10, ((Conv(8),),))])
    with pytest.raises(ValueError, match="incompatible members"):
        mother_of([vgg, VGG((3, 16, 16), 10, vgg.blocks)])
    with pytest.raises(ValueError, match="incompatible members"):
        mother_of([vgg, MLP(SHAPE, 10, (8,))])
    with pytest.raises(ValueError, match="at least one"):
        mother_of([])


def sized(widths):
    return [MLP(SHAPE, 10, (w,)) for w in widths]


def test_cluster_extremes():
    members = sized([40, 10, 30, 20])
    assert cluster(members, 1) == [[0, 1, 2, 3]]
    assert cluster(members, 4) == [[0], [1], [2], [3]]
    for c in cluster(members, 4):
        assert mother_of([members[i] for i in c]) == members[c[0]]


def test_cluster_groups_similar_sizes():
    members = sized([40, 10, 30, 20, 50, 60])
    assert cluster(members, 2) == [[0, 4, 5], [1, 2, 3]]
    assert cluster(members, 3) == [[0, 2], [1, 3], [4, 5]]


@pytest.mark.parametrize("g", [0, 5, 100])
def test_cluster_count_out_of_range(g):
    with pytest.raises(ValueError, match="between 1 and the ensemble size 4"):
        cluster(sized([1, 2, 3, 4]), g)


def test_incompatible_families_need_their_own_clusters():
    mixed = Generator("mixed", blocks=2).sample(12, SHAPE, 10, 0)
    families = {m.family for m in mixed}
    assert len(families) == 3
    with pytest.raises(ValueError, match="3 groups that cannot share a mother"):
        cluster(mixed, 2)
    clusters = cluster(mixed, 3)
    assert sorted(i for c in clusters for i in c) == list(range(12))
    assert all(len({mixed[i].family for i in c}) == 1 for c in clusters)
    for g in range(3, 13):  # every g is reachable and every cluster has a mother
        clusters = cluster(mixed, g)
        assert len(clusters) == g
        for c in clusters:
            mother_of([mixed[i] for i in c])
