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


@pytest.mark.parametrize("kwargs, borrowed, room", [
    ({"dp_shard": 4, "ep": 3}, 1, 4), ({"dp_shard": 2, "cp": 4, "ep": 2}, 4, 8),
    ({"dp_shard": 2, "cp": 2, "ep": 8}, 2, 4), ({"dp_shard": 8, "ep": 0}, 1, 8),
    # Under TP the expert group holds every TP rank: EP 2 cannot fit TP 4, nor EP 8 in dp_shard 2 x TP 2.
    ({"dp_shard": 2, "tp": 4, "ep": 2}, 4, 8), ({"dp_shard": 2, "tp": 2, "ep": 8}, 2, 4),
    ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 2}, 4, 8)])
def test_expert_parallel_must_fit_in_dp_shard_times_cp_times_tp(kwargs, borrowed, room):
    world = kwargs["dp_shard"] * kwargs.get("cp", 1) * kwargs.get("tp", 1)
    with pytest.raises(ValueError, match=(
            f"^expert_parallel_degree {kwargs['ep']} must be a multiple of context_parallel_degree x "
            f"tensor_parallel_degree = {borrowed} and divide data_parallel_shard_degree x context_parallel_degree x "
            f"tensor_parallel_degree = {room}: expert parallel borrows all the cp and tp ranks and some of dp_shard$")):
        ParallelDims(dp_replicate=1, pp=1, world_size=world, **{"cp": 1, "tp": 1, **kwargs})


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield init
    dist.destroy_process_group()


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


@pytest.mark.parametrize(
    "kwargs, groups",
    [  # world 8 = dp_shard 4 x tp 2, ep 4: an expert group is both TP ranks of 2 ranks of dp_shard, experts FSDP
        # over the other 2.
        ({"dp_shard": 4, "tp": 2, "ep": 4},
         {"ep": [0, 1, 2, 3], "dp_shard_mod_ep": [0, 4], "dp_shard": [0, 2, 4, 6], "dp": [0, 2, 4, 6], "tp": [0, 1]}),
        # ep 2 = tp 2: the expert group is the TP ranks, experts FSDP over all of dp_shard.
        ({"dp_shard": 4, "tp": 2, "ep": 2},
         {"ep": [0, 1], "dp_shard_mod_ep": [0, 2, 4, 6], "dp_shard": [0, 2, 4, 6], "tp": [0, 1]}),
        # ep 4 = all of cp 2 and 2 of dp_shard 4; dp_shard_cp still spans the 8 ranks.
        ({"dp_shard": 4, "cp": 2, "ep": 4},
         {"ep": [0, 1, 2, 3], "dp_shard_mod_ep": [0, 4], "dp_shard": [0, 2, 4, 6], "dp_shard_cp": list(range(8))}),
        # ep over all of dp_shard, HSDP replicas outside.
        ({"dp_replicate": 2, "dp_shard": 4, "ep": 4},
         {"ep": [0, 1, 2, 3], "dp_shard": [0, 1, 2, 3], "dp": list(range(8)), "dp_replicate": [0, 4]}),
    ],
)
def test_expert_parallel_meshes_borrow_data_parallel_ranks(fake_world, kwargs, groups):
    fake_world(8)
    pd = ParallelDims(**{"dp_replicate": 1, "cp": 1, "tp": 1, "pp": 1, "world_size": 8, **kwargs})
    pd.build_mesh("cpu")
    assert pd.ep_enabled and pd.dp_degree == kwargs.get("dp_replicate", 1) * kwargs["dp_shard"]
    for name, ranks in groups.items():
        assert _ranks(pd.submesh(name)) == ranks, name


@pytest.mark.parametrize(
    "kwargs, groups",
    [  # A MoE layer under TP 2 x FSDP 2: its FSDP unit spans the data-parallel and TP ranks, as do its token counts.
        # The sequence-wise balance loss counts each sequence over cp_tp, here the TP ranks alone.
        ({"dp_shard": 2, "tp": 2}, {"dp_shard_cp_tp": [0, 1, 2, 3], "dp_cp_tp": [0, 1, 2, 3], "dp_shard": [0, 2],
                                    "cp_tp": [0, 1]}),
        # EP 2 x TP 2 with HSDP replicas: the expert group is the TP ranks, the experts FSDP over dp_shard.
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 2, "ep": 2},
         {"ep": [0, 1], "dp_shard_mod_ep": [0, 2], "dp_shard_cp_tp": [0, 1, 2, 3], "dp_cp_tp": list(range(8))}),
        # EP 4 = CP 2 x TP 2: no rank left for the experts' FSDP.
        ({"dp_shard": 1, "cp": 2, "tp": 2, "ep": 4}, {"ep": [0, 1, 2, 3], "dp_shard_mod_ep": None, "tp": [0, 1],
                                                      "cp_tp": [0, 1, 2, 3]}),
        # EP 2 x TP 2 on 2 ranks: the experts split over the TP ranks, no data parallel beside them.
        ({"dp_shard": 1, "tp": 2, "ep": 2}, {"ep": [0, 1], "dp_shard_mod_ep": None, "dp_shard_cp_tp": [0, 1]}),
    ],
)
def test_tensor_parallel_views_for_mixtures_of_experts(fake_world, kwargs, groups):
    world = kwargs.get("dp_replicate", 1) * kwargs["dp_shard"] * kwargs.get("cp", 1) * kwargs["tp"]
    fake_world(world)
    pd = ParallelDims(**{"dp_replicate": 1, "cp": 1, "pp": 1, "world_size": world, **kwargs})
    pd.build_mesh("cpu")
    for name, ranks in groups.items():
        assert (_ranks(pd.submesh(name)) if ranks is not None else pd.submesh(name)) == ranks, name


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim")  # what data_parallel does, as TorchTitan
@pytest.mark.parametrize("kwargs, shard", [({"dp_shard": 4, "ep": 4}, "dp_shard_in_ep"),
                                           ({"dp_shard": 4, "ep": 2}, "dp_shard"), ({"dp_shard": 4}, "dp_shard")])
def test_hsdp_slices_replicas_by_whatever_holds_dp_shard(fake_world, kwargs, shard):
    fake_world(8)
    pd = ParallelDims(**{"dp_replicate": 2, "cp": 1, "tp": 1, "pp": 1, "world_size": 8, **kwargs})
    pd.build_mesh("cpu")
    assert pd.mesh_dim_name("dp_shard") == shard
    assert pd.world_mesh[("dp_replicate", shard)].shape == (2, 4)
