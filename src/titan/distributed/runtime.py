"""Process-group lifecycle: torchrun environment or a single process; NCCL on CUDA, gloo on the CPU."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan.compat import set_group_timeout
from titan.tools.logging import logger


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


def process_group_env(backend: str, trace_buf_size: int, distributed_debug: str, dump_folder: str) -> dict[str, str]:
    """The variables c10d reads when it creates process groups: the NCCL flight recorder and the debug level."""
    env = {}
    if trace_buf_size > 0 and backend == "nccl":
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(trace_buf_size)
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        # The recorder appends the rank to this prefix.
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(dump_folder, "comm_traces", "rank_").absolute())
    if distributed_debug != "off":
        env["TORCH_DISTRIBUTED_DEBUG"] = distributed_debug.upper()
    return env


def apply_env(env: dict[str, str]) -> dict[str, str]:
    """Sets the variables the user has not set (theirs win), logs both kinds and returns the ones it set."""
    ours = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(ours)
    if ours:
        logger.info("process-group environment: " + " ".join(f"{k}={v}" for k, v in ours.items()))
    for key, value in env.items():
        if key not in ours and os.environ[key] != value:
            logger.info(f"{key}={os.environ[key]} from the environment wins over the config's {value}")
    if "TORCH_DISTRIBUTED_DEBUG" in ours:
        # c10d reads the debug level when torch.distributed is imported, long before this point.
        dist.set_debug_level_from_env()
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in ours:
        Path(ours["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    return ours


def init_distributed(timeout_seconds: int = 300, trace_buf_size: int = 0, distributed_debug: str = "off",
                     dump_folder: str = ".") -> torch.device:
    """Joins the process group that torchrun described (idempotent) and returns this rank's device.

    A plain `python -m ...` (no torchrun variables) runs as world size 1 with no process group.
    """
    dev = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(dev, local_rank) if dev == "cuda" else torch.device("cpu")
    if dev == "cuda":
        torch.cuda.set_device(device)
    if world_size_from_env() > 1 and not dist.is_initialized():
        if trace_buf_size > 0 and backend_for(dev) != "nccl":
            logger.info("comm.trace_buf_size: the flight recorder dumps on NCCL timeouts only; off on gloo")
        apply_env(process_group_env(backend_for(dev), trace_buf_size, distributed_debug, dump_folder))
        dist.init_process_group(
            backend=backend_for(dev),
            timeout=timedelta(seconds=timeout_seconds),
            device_id=device if dev == "cuda" else None,
            **_elastic_store_kwargs(timeout_seconds),
        )
        logger.info(f"joined process group: backend={backend_for(dev)} world={dist.get_world_size()}")
    return device


def set_pg_timeouts(timeout_seconds: int, mesh: DeviceMesh | None) -> list[dist.ProcessGroup]:
    """Gives the default group and every group of `mesh` a new collective timeout; returns those groups.

    The first step (compilation, allocation, checkpoint loading) runs under the long init timeout; after it a
    hung collective should fail fast.
    """
    # A rank still in its first step must not meet a peer's collective under the shorter timeout.
    dist.barrier()
    groups = [dist.group.WORLD]
    if mesh is not None:
        groups += mesh.get_all_groups()
        # Flattened views (dp, dp_shard_cp, dp_cp) have groups of their own, kept by name on the root mesh.
        groups += [mesh.get_group(name) for name in mesh._flatten_mapping]
    unique = list({id(g): g for g in groups}.values())
    for group in unique:
        set_group_timeout(timedelta(seconds=timeout_seconds), group)
    logger.info(f"collective timeout now {timeout_seconds} s on {len(unique)} process group(s)")
    return unique


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


def warn_if_cores_are_busy(threads: int, device: torch.device) -> None:
    """One warning when other jobs already load every core: then each of several threads waits for the others at
    every op, and one thread can be several times faster (benchmarks/RESULTS.md)."""
    if device.type != "cpu" or threads < 2 or not hasattr(os, "getloadavg"):
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        logger.warning(f"this machine is busy (load average {load:.1f} on {cores} cores): {threads} threads per "
                       "process wait for each other at every op there; --debug.threads 1 can be several times faster")


def shutdown() -> None:
    """Leaves the process group cleanly: a barrier first so no rank tears down gloo under a peer."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
