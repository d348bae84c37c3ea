"""Counts the collectives a rank issues, per kind and process group: calls and payload bytes.

    with CommStats(labels=group_labels(parallel_dims)) as stats:
        trainer.train_step(...)
    stats.table()  # {(kind, group): {"calls": n, "bytes": b}}

A TorchDispatchMode sees every op the dispatcher runs on this thread, below autograd and DTensor: the c10d ops
behind torch.distributed's Python API (FSDP2's all_gather_into_tensor / reduce_scatter_tensor, all_reduce,
pipeline send/recv and batch_isend_irecv), and the functional collectives of DTensor redistributions, loss
parallel and the context-parallel ring (_c10d_functional). Ops a handler runs inside another op's dispatch
(e.g. the c10d call a functional collective makes) do not reach the mode, so nothing counts twice.

Byte convention: payload bytes of one call on this rank, the larger of what its input and output tensors hold.
That is the full (gathered) tensor for all-gather, the full (unreduced) input for reduce-scatter, the tensor for
all-reduce, broadcast, send and recv, and the local input for all-to-all. Ring wire traffic is (n-1)/n of it for
all-gather and reduce-scatter, 2(n-1)/n for all-reduce.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# (op namespace, op name) -> collective kind. Ops an older torch lacks are skipped, so importing titan never
# depends on the exact set of c10d ops.
_OPS = {
    ("c10d", "_allgather_base_"): "all_gather",
    ("c10d", "allgather_"): "all_gather",
    ("c10d", "allgather_coalesced_"): "all_gather",
    ("c10d", "allgather_into_tensor_coalesced_"): "all_gather",
    ("c10d", "_reduce_scatter_base_"): "reduce_scatter",
    ("c10d", "reduce_scatter_"): "reduce_scatter",
    ("c10d", "reduce_scatter_tensor_coalesced_"): "reduce_scatter",
    ("c10d", "allreduce_"): "all_reduce",
    ("c10d", "allreduce_coalesced_"): "all_reduce",
    ("c10d", "alltoall_"): "all_to_all",
    ("c10d", "alltoall_base_"): "all_to_all",
    ("c10d", "broadcast_"): "broadcast",
    ("c10d", "reduce_"): "reduce",
    ("c10d", "gather_"): "gather",
    ("c10d", "gather_into_tensor_"): "gather",
    ("c10d", "scatter_"): "scatter",
    ("c10d", "send"): "send",
    ("c10d", "recv_"): "recv",
    ("c10d", "recv_any_source_"): "recv",
    ("_c10d_functional", "all_gather_into_tensor"): "all_gather",
    ("_c10d_functional", "all_gather_into_tensor_out"): "all_gather",
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): "all_gather",
    ("_c10d_functional", "reduce_scatter_tensor"): "reduce_scatter",
    ("_c10d_functional", "reduce_scatter_tensor_out"): "reduce_scatter",
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): "reduce_scatter",
    ("_c10d_functional", "all_reduce"): "all_reduce",
    ("_c10d_functional", "all_reduce_"): "all_reduce",
    ("_c10d_functional", "all_reduce_coalesced"): "all_reduce",
    ("_c10d_functional", "all_reduce_coalesced_"): "all_reduce",
    ("_c10d_functional", "all_to_all_single"): "all_to_all",
    ("_c10d_functional", "broadcast"): "broadcast",
    ("_c10d_functional", "broadcast_"): "broadcast",
    ("_c10d_functional", "isend"): "send",
    ("_c10d_functional", "irecv"): "recv",
    ("_c10d_functional_autograd", "all_gather_into_tensor"): "all_gather",
    ("_c10d_functional_autograd", "reduce_scatter_tensor"): "reduce_scatter",
    ("_c10d_functional_autograd", "all_to_all_single"): "all_to_all",
}
KINDS = {getattr(getattr(torch.ops, space), name): kind for (space, name), kind in _OPS.items()
         if hasattr(getattr(torch.ops, space), name)}


def _nbytes(values: Iterable) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor))


def _process_group(group) -> dist.ProcessGroup:
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        return _resolve_process_group(group)
    # c10d ops carry the group as a TorchScript object.
    return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)


def group_labels(parallel_dims) -> dict[tuple[int, ...], str]:
    """Global ranks of a group -> mesh dimension name, for a ParallelDims with a built mesh; the default group
    is "world". Groups are told apart by their ranks, not their names: meshes that compare equal (the same
    ranks and dim names, e.g. two Trainers in one process) can share cached groups. The first name wins when
    several dims span the same ranks (plain dims before flattened ones)."""
    labels: dict[tuple[int, ...], str] = {}
    for name in ("tp", "cp", "pp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp", "dp_cp", "ep",
                 "dp_shard_cp_tp", "dp_cp_tp"):
        mesh = parallel_dims.submesh(name)
        if mesh is not None and mesh.ndim == 1:
            labels.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group())), name)
    if dist.is_initialized():
        labels.setdefault(tuple(range(dist.get_world_size())), "world")
    return labels


class CommStats(TorchDispatchMode):
    """Calls and payload bytes per (collective kind, group label) issued on this thread while active.

    `labels` maps a group's global ranks to a readable name (see `group_labels`); other groups show their ranks.
    """

    def __init__(self, labels: dict[tuple[int, ...], str] | None = None):
        super().__init__()
        self.labels = labels or {}
        self._group_labels: dict[str, str] = {}
        self.counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"calls": 0, "bytes": 0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, FakeTensor) for t in types):
            # Shape propagation (DTensor's sharding cache on an op's first call) moves no data.
            return func(*args, **(kwargs or {}))
        if any(t is not torch.Tensor for t in types):
            # Let tensor subclasses (DTensor, async collective results) run first: the collectives they issue
            # come back here as plain-tensor ops.
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Higher-order operators (e.g. under activation checkpointing) have no overload packet; none is a collective.
        kind = KINDS.get(getattr(func, "_overloadpacket", None))
        if kind is not None:
            self._record(func, kind, args, kwargs, out)
        return out

    def _record(self, func, kind: str, args, kwargs, out) -> None:
        named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        inputs = _nbytes(v for k, v in named.items() if not k.startswith("out"))
        outputs = max(_nbytes(v for k, v in named.items() if k.startswith("out")), _nbytes([out]))
        group = _process_group(named.get("process_group", named.get("group_name")))
        if group.group_name not in self._group_labels:
            ranks = tuple(dist.get_process_group_ranks(group))
            self._group_labels[group.group_name] = self.labels.get(ranks, ",".join(map(str, ranks)))
        entry = self.counts[(kind, self._group_labels[group.group_name])]
        entry["calls"] += 1
        entry["bytes"] += max(inputs, outputs)

    def table(self) -> dict[tuple[str, str], dict[str, int]]:
        return {k: dict(v) for k, v in sorted(self.counts.items())}


def counted_step(step_fn, parallel_dims) -> dict:
    """Runs one training step under CommStats; its output dict gains `comm_bytes`: payload bytes per
    "kind:group" (metrics.comm_stats)."""
    with CommStats(group_labels(parallel_dims)) as stats:
        out = step_fn()
    return {**out, "comm_bytes": {f"{kind}:{group}": v["bytes"] for (kind, group), v in stats.table().items()}}
