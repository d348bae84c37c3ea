"""ParallelDims: degrees multiply to the world size; -1 takes the rest; impossible layouts say why."""

import pytest

from titan.distributed import ParallelDims


def dims(world, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1):
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)


def test_world_size_one_needs_no_mesh():
    pd = dims(1)
    assert pd.dp_shard == 1 and not pd.fsdp_enabled and not pd.dp_enabled
    assert pd.build_mesh("cpu") is None
    assert pd.dp_rank() == 0


@pytest.mark.parametrize(
    "world, kwargs, dp_shard, dp_degree",
    [(8, {}, 8, 8), (8, {"tp": 2}, 4, 4), (8, {"dp_replicate": 2}, 4, 8), (16, {"tp": 2, "pp": 2, "cp": 2}, 2, 2)],
)
def test_minus_one_takes_the_rest(world, kwargs, dp_shard, dp_degree):
    pd = dims(world, **kwargs)
    assert pd.dp_shard == dp_shard
    assert pd.dp_degree == dp_degree


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"multiply to 8 .* but the world size is 4"):
        dims(4, dp_shard=2, tp=4)


def test_rest_must_divide():
    with pytest.raises(ValueError, match="world size 6 is not divisible by dp_replicate\\*cp\\*tp\\*pp = 4"):
        dims(6, tp=4)


def test_non_positive_degree():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        dims(2, tp=0)
