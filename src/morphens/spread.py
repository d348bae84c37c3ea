"""Spreading an ensemble's members over the ranks of a torchrun job (`training.spread members`).

The mothers (each with its snapshot cycles), then the members, are dealt out over the ranks by cost and each is
trained on its rank alone (titan's solo mode: a small net trained on all ranks through FSDP ran slower than on
one); the mothers' snapshots travel to every rank, and the members' results are gathered on every rank.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from morphens.arch import Arch
from morphens.config import RunConfig
from morphens.models import Net

T = TypeVar("T")


def spreading(cfg: RunConfig) -> bool:
    """Whether members are spread over the ranks of a torchrun job (`training.spread members`)."""
    return cfg.training.spread == "members" and dist.is_initialized() and dist.get_world_size() > 1


def deal(costs: list[float], ranks: int) -> list[int]:
    """The rank of each job: the costliest first, each to the rank with the least cost so far, so that ranks
    finish together (dealt in turn, one rank can draw all the largest members)."""
    load, out = [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        out[i] = min(range(ranks), key=lambda r: load[r])
        load[out[i]] += costs[i]
    return out


def owners(cfg: RunConfig, costs: list[float]) -> list[int]:
    """The rank that trains each net of these costs (FLOPs): all on this one unless spreading."""
    return deal(costs, dist.get_world_size()) if spreading(cfg) else [0] * len(costs)


def my_nets(cfg: RunConfig, costs: list[float]) -> list[int]:
    """The nets, of these costs, that this process trains (all of them unless spreading)."""
    rank = dist.get_rank() if spreading(cfg) else 0
    return [i for i, owner in enumerate(owners(cfg, costs)) if owner == rank]


@functools.cache
def gather_group() -> dist.ProcessGroup:
    """The group members' results travel on. Ranks wait in it for the slowest rank's members, far longer than
    titan's collective timeout after a mother's first step allows; experiment() creates it while ranks are in step."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=7))


def gathered(cfg: RunConfig, mine: dict[int, T]) -> list[T]:
    """Every net's entry in net order, on every rank (each rank only holds its own when spreading)."""
    if spreading(cfg):
        parts: list[dict[int, T]] = [{}] * dist.get_world_size()
        dist.all_gather_object(parts, mine, group=gather_group())
        mine = {i: entry for part in parts for i, entry in part.items()}
    return [mine[i] for i in sorted(mine)]


def shared_nets(cfg: RunConfig, mine: dict[int, list[Net]], chains: list[tuple[Arch, int]],
                owner: list[int]) -> list[list[Net]]:
    """Every chain's nets on every rank, in chain order: chain j is `count` nets of `arch` that rank owner[j]
    trained. Their tensors are broadcast from that rank over the gather group; nothing is pickled."""
    if not spreading(cfg):
        return [mine[j] for j in range(len(chains))]
    out = []
    for j, (arch, count) in enumerate(chains):
        nets = mine.get(j) or [Net(arch).eval() for _ in range(count)]
        for net in nets:
            for tensor in net.state_dict().values():
                dist.broadcast(tensor, src=owner[j], group=gather_group())
        out.append(nets)
    return out
