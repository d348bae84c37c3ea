"""Spreading an ensemble's members over the ranks of a torchrun job (`training.spread members`).

Mothers train on all ranks (FSDP); each rank then trains every world-th member alone (titan's solo mode) and the
members' results are gathered on every rank.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch.distributed as dist

from morphens.config import RunConfig


def spreading(cfg: RunConfig) -> bool:
    """Whether members are spread over the ranks of a torchrun job (`training.spread members`)."""
    return cfg.training.spread == "members" and dist.is_initialized() and dist.get_world_size() > 1


def my_members(cfg: RunConfig, count: int) -> list[int]:
    """The members this process trains: all of them, or when spreading every world-th one from its rank."""
    return list(range(dist.get_rank(), count, dist.get_world_size()) if spreading(cfg) else range(count))


@functools.cache
def gather_group() -> dist.ProcessGroup:
    """The group members' results travel on. Ranks wait in it for the slowest rank's members, far longer than
    titan's collective timeout after a mother's first step allows; experiment() creates it while ranks are in step."""
    return dist.new_group(backend="gloo", timeout=timedelta(days=7))


def gathered(cfg: RunConfig, mine: dict[int, dict]) -> list[dict]:
    """Every member's entry in member order, on every rank (each rank only holds its own when spreading)."""
    if spreading(cfg):
        parts: list[dict] = [{}] * dist.get_world_size()
        dist.all_gather_object(parts, mine, group=gather_group())
        mine = {i: entry for part in parts for i, entry in part.items()}
    return [mine[i] for i in sorted(mine)]
