"""Which mesh FSDP shards over, and when it reshards after forward: HSDP over (dp_replicate, dp_shard), FSDP over
dp_shard x cp, replicas alone sharded too; pipeline parallel keeps a stage gathered unless told "always"."""

from types import SimpleNamespace

import pytest
import torch

from titan.config import parse_args
from titan.distributed import data_parallel

# The 2-D meshes HSDP takes from the world mesh, by the names it asks for.
HSDP_MESHES = {("dp_replicate", "dp_shard"): "hsdp", ("dp_replicate", "cp"): "hsdp-cp",
               ("dp_replicate", "dp_shard_cp"): "hsdp-both"}


def dims(dp_replicate=1, dp_shard=1, cp=1, pp=1):
    return SimpleNamespace(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, fsdp_enabled=dp_shard * cp > 1,
                           dp_replicate_enabled=dp_replicate > 1, cp_enabled=cp > 1, pp_enabled=pp > 1,
                           world_mesh=HSDP_MESHES, submesh=lambda name: name, mesh_dim_name=lambda name: name)


@pytest.fixture
def fsdp_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(data_parallel, "apply_fsdp", lambda model, mesh, **kw: calls.append((mesh, kw)))
    return calls


@pytest.mark.parametrize("layout, mesh", [
    (dict(dp_shard=4), "dp_shard_cp"), (dict(dp_shard=2, cp=2), "dp_shard_cp"), (dict(dp_replicate=2), "dp_replicate"),
    (dict(dp_replicate=2, dp_shard=2), "hsdp"), (dict(dp_replicate=2, cp=2), "hsdp-cp"),
    (dict(dp_replicate=2, dp_shard=2, cp=2), "hsdp-both"),
])
def test_the_mesh_fsdp_shards_over(fsdp_calls, layout, mesh):
    data_parallel.apply_data_parallel(None, dims(**layout), parse_args(["--training.mixed_precision_param", "float16"]))
    assert fsdp_calls == [(mesh, {"param_dtype": torch.float16, "reduce_dtype": torch.float32,
                                  "reshard_after_forward": True, "ignored_params": None})]


@pytest.mark.parametrize("setting, pp, reshard", [("default", 1, True), ("default", 2, False), ("always", 2, True),
                                                  ("never", 1, False)])
def test_reshard_after_forward_follows_the_setting_and_pipeline_parallel(fsdp_calls, setting, pp, reshard):
    config = parse_args(["--parallelism.fsdp_reshard_after_forward", setting])
    data_parallel.apply_data_parallel(None, dims(dp_shard=2, pp=pp), config)
    assert fsdp_calls[0][1]["reshard_after_forward"] is reshard


def test_one_rank_is_left_alone(fsdp_calls):
    model = torch.nn.Linear(2, 2)
    assert data_parallel.apply_data_parallel(model, dims(), parse_args([])) is model and fsdp_calls == []
