"""Process-group lifecycle: torchrun environment or a single process; NCCL on CUDA, gloo on the CPU."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from titan.metrics.logging import logger


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _elastic_store_kwargs(timeout_seconds: int) -> dict:
    """Under torchrun's agent store, keys of a previous attempt (dead peers' addresses) outlive it and a
    restarted worker group can hang reading them: give every restart its own key prefix."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size_from_env(),
                          is_master=False, timeout=timedelta(seconds=timeout_seconds))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"titan/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": world_size_from_env()}


def init_distributed(timeout_seconds: int = 300) -> torch.device:
    """Joins the process group that torchrun described (idempotent) and returns this rank's device.

    A plain `python -m ...` (no torchrun variables) runs as world size 1 with no process group.
    """
    dev = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(dev, local_rank) if dev == "cuda" else torch.device("cpu")
    if dev == "cuda":
        torch.cuda.set_device(device)
    if world_size_from_env() > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend_for(dev),
            timeout=timedelta(seconds=timeout_seconds),
            device_id=device if dev == "cuda" else None,
            **_elastic_store_kwargs(timeout_seconds),
        )
        logger.info(f"joined process group: backend={backend_for(dev)} world={dist.get_world_size()}")
    return device


def set_default_threads(requested: int) -> int:
    """Gives each local process its share of the cores unless a thread count is asked for."""
    if requested > 0:
        threads = requested
    elif "OMP_NUM_THREADS" in os.environ:
        threads = torch.get_num_threads()
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    return threads


def shutdown() -> None:
    """Leaves the process group cleanly: a barrier first so no rank tears down gloo under a peer."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
