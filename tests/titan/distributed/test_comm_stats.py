"""CommStats counts every collective path the trainer uses, with payload bytes: c10d ops (all_reduce,
all_gather_into_tensor, reduce_scatter_tensor, send/recv, batch_isend_irecv), functional collectives with and
without autograd, DTensor redistributions, and FSDP2's all-gathers and reduce-scatters in a real step.

One torchrun of 2 gloo ranks runs this file as its worker (below) and writes what it counted; the tests read it.
"""

import json
import sys

import pytest

from tests.titan.conftest import TINY, run_train

F32 = 4  # bytes


@pytest.fixture(scope="module")
def counted(module_tmp_path):
    out = module_tmp_path
    run_train([str(out / "counts.json"), *TINY, "--job.dump_folder", str(out / "run")], nproc=2,
              module="tests.titan.distributed.test_comm_stats", timeout=120)
    return json.loads((out / "counts.json").read_text())


def test_c10d_collectives_count_payload_bytes(counted):
    rank0 = counted["0"]
    assert rank0["all_reduce"] == [["all_reduce", "world", 1, 10 * F32]]
    # all-gather: the gathered tensor (2 ranks x 3); reduce-scatter: the full input of 8.
    assert rank0["all_gather"] == [["all_gather", "world", 1, 6 * F32]]
    assert rank0["reduce_scatter"] == [["reduce_scatter", "world", 1, 8 * F32]]


def test_point_to_point_counts_each_side(counted):
    assert counted["0"]["send_recv"] == [["send", "world", 1, 6 * F32]]
    assert counted["1"]["send_recv"] == [["recv", "world", 1, 6 * F32]]
    # batch_isend_irecv: one send and one receive of 4 floats on every rank.
    for rank in "01":
        assert counted[rank]["batch_p2p"] == [["recv", "world", 1, 4 * F32], ["send", "world", 1, 4 * F32]]


def test_functional_and_dtensor_collectives_on_a_mesh_group(counted):
    rank0 = counted["0"]
    # bfloat16 all-reduce of 5 elements; the autograd all-to-all counts forward and backward, not twice each.
    assert rank0["functional"] == [["all_reduce", "tp", 1, 5 * 2], ["all_to_all", "tp", 2, 2 * 8 * F32]]
    # Shard(0) -> Replicate of a 4 x 6 float tensor gathers all 24 elements.
    assert rank0["dtensor"] == [["all_gather", "tp", 1, 24 * F32]]


def test_an_ops_first_dtensor_call_is_counted_not_refused(counted):
    # Row-sharded embedding: each rank looks up its rows, zeros the rest, and the partial sums are all-reduced.
    assert counted["0"]["first_dtensor_op"] == [["all_reduce", "tp", 1, 3 * 6 * F32]]


def test_fsdp_step_gathers_every_unit_twice_but_the_last_block(counted):
    fsdp = counted["0"]["fsdp"]
    rows = {kind: (calls, nbytes) for kind, group, calls, nbytes in fsdp["table"] if group == "dp_shard"}
    units = fsdp["blocks"] + 1
    # Forward gathers every unit; backward again all but the last block, which stays gathered (reshard
    # after forward is off for it). fp32 parameters and gradients: 4 bytes an element.
    assert rows["all_gather"] == (2 * units - 1, F32 * (2 * fsdp["params"] - fsdp["last_block_params"]))
    assert rows["reduce_scatter"] == (units, F32 * fsdp["params"])


def test_metrics_comm_stats_logs_each_collective_bytes(counted):
    fsdp = counted["0"]["fsdp"]
    expected = {f"{kind}:{group}": nbytes for kind, group, _, nbytes in fsdp["table"]}
    # The stop-signal flags ride on the loss's all-reduce: the step has no collective of its own outside it.
    assert counted["0"]["logged"] == expected


def _worker(out_path: str, train_args: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ft_c
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from titan.config import parse_args
    from titan.distributed.comm_stats import CommStats, group_labels
    from titan.trainer import Trainer

    trainer = Trainer(parse_args([*train_args, "--training.steps", "3"]))
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    world = {(0, 1): "world"}
    results = {}

    def count(name, fn, labels=world):
        with CommStats(labels) as stats:
            fn()
        results[name] = [[*key, v["calls"], v["bytes"]] for key, v in stats.table().items()]

    count("all_reduce", lambda: dist.all_reduce(torch.ones(10)))
    count("all_gather", lambda: dist.all_gather_into_tensor(torch.empty(6), torch.ones(3)))
    count("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8)))
    count("send_recv", lambda: dist.send(torch.ones(6), 1) if rank == 0 else dist.recv(torch.empty(6), 0))

    def batch_p2p():
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, torch.empty(4), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    count("batch_p2p", batch_p2p)
    labels = {(0, 1): "tp"}

    def functional():
        ft_c.all_reduce(torch.ones(5, dtype=torch.bfloat16), "sum", tp).wait()
        ft_c.all_to_all_single_autograd(torch.ones(8, requires_grad=True), None, None, tp).sum().backward()

    count("functional", functional, labels)
    sharded = distribute_tensor(torch.ones(4, 6), tp, [Shard(0)])
    count("dtensor", lambda: sharded.redistribute(tp, [Replicate()]).to_local(), labels)
    # An op's first call on DTensors propagates shardings on fake tensors: that must pass through the counter.
    table = distribute_tensor(torch.ones(8, 6), tp, [Shard(0)])
    ids = distribute_tensor(torch.tensor([[1, 2, 3]]), tp, [Replicate()])
    count("first_dtensor_op", lambda: torch.nn.functional.embedding(ids, table).full_tensor(), labels)

    trainer.config.training.steps = 1
    trainer.train()
    trainer.config.training.steps = 2
    with CommStats(group_labels(trainer.parallel_dims)) as stats:
        trainer.train()
    blocks = list(trainer.model.layers.values())
    results["fsdp"] = {"table": [[*k, v["calls"], v["bytes"]] for k, v in stats.table().items()],
                       "params": sum(p.numel() for p in trainer.model.parameters()),
                       "last_block_params": sum(p.numel() for p in blocks[-1].parameters()), "blocks": len(blocks)}
    trainer.config.metrics.comm_stats = True
    trainer.config.training.steps = 3
    trainer.train()
    results["logged"] = trainer.history[-1].get("comm_bytes")
    trainer.close()
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({str(r): res for r, res in enumerate(gathered)}, f)


if __name__ == "__main__":
    import os

    from titan.distributed.runtime import shutdown

    _worker(sys.argv[1], sys.argv[2:])
    shutdown()
    # As titan.train: gloo's threads can stall a normal interpreter exit.
    sys.stdout.flush()
    os._exit(0)
