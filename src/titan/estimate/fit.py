"""Checks before a run starts that it fits this machine: memory (from the estimator) and checkpoint size."""

from __future__ import annotations

import dataclasses
import json
import os
import traceback

import torch
import torch.distributed as dist

from titan.estimate.blocks import estimable
from titan.estimate.costs import GIB, Hardware
from titan.estimate.memory import OPTIMIZER_STATES
from titan.models import get_model_spec
from titan.tools.cli import UserError
from titan.tools.logging import logger


def available_bytes() -> tuple[float, str]:
    """Memory one rank of this job may use: its GPU's, or the node's available RAM over its local ranks."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return float(torch.cuda.get_device_properties(device).total_memory), "GPU memory"
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kib * 1024 / local_ranks, f"available RAM{f' / {local_ranks} local ranks' if local_ranks > 1 else ''}"


def estimated_peak_bytes(job_config, world_size: int) -> dict[str, float] | None:
    """The estimator's memory of this run's most loaded rank, by kind; None for a model it cannot estimate."""
    from titan.builders import stand_in_model_args  # the builders import this module
    from titan.estimate.dry_run import estimate

    spec = get_model_spec(job_config.model.name, job_config.model.spec)
    if not estimable(spec.flavors.get(job_config.model.flavor)):
        return None
    try:
        args = stand_in_model_args(spec, job_config)
    except UserError:
        # The estimate stands in the flavor's vocabulary for the tokenizer; a model it cannot resolve so (e.g. one
        # whose architecture comes from an HF folder) is left to the run, which reports with the real tokenizer.
        return None
    if not estimable(args):
        return None
    config = dataclasses.replace(job_config, comm=dataclasses.replace(job_config.comm, world_size=world_size))
    report = estimate(config, Hardware(peak_tflops=1.0))
    return max((r["memory_bytes"] for r in report["ranks"]), key=lambda m: sum(m.values()))


def estimated_peak_bytes_in_child(job_config, world_size: int) -> dict[str, float] | None:
    """`estimated_peak_bytes` in a forked child: the dry run meshes a fake process group, and DeviceMesh keeps
    state of it that breaks this process's real mesh later (DCP then saved one shard of two). The estimate
    itself is cheap (on the meta device); fork copies the imported modules, so no import is paid again."""
    if not hasattr(os, "fork"):
        return estimated_peak_bytes(job_config, world_size) if world_size == 1 else None
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code (no atexit, no test runner teardown)
        os.close(read_fd)
        logger.setLevel("WARNING")  # the dry run's mesh and FSDP lines are not this run's
        try:
            reply = {"memory": estimated_peak_bytes(job_config, world_size)}
        except UserError as e:
            reply = {"user_error": str(e)}
        except BaseException:
            reply = {"bug": traceback.format_exc()}
        with os.fdopen(write_fd, "w") as f:
            json.dump(reply, f)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        raise RuntimeError(f"the memory check's child process died (wait status {status}) without a reply")
    reply = json.loads(text)
    if "user_error" in reply:
        raise UserError(reply["user_error"])
    if "bug" in reply:
        raise RuntimeError(f"the memory check's estimate failed:\n{reply['bug']}")
    return reply["memory"]


def check_memory(job_config, world_size: int) -> None:
    """Refuses, before anything is built, a run whose estimated peak memory per rank exceeds what it has.

    Every rank checks (the same numbers, so they agree) before its process group exists; rank 0 reports."""
    if not job_config.debug.memory_check or dist.is_initialized():
        return
    memory = estimated_peak_bytes_in_child(job_config, world_size)
    if memory is None:
        return
    need, (have, what) = sum(memory.values()), available_bytes()
    top = sorted(memory.items(), key=lambda kv: -kv[1])[:2]
    logger.info(f"estimated peak memory {need / GIB:.2f} GiB per rank, {what} {have / GIB:.1f} GiB")
    if need > have:
        t = job_config.training
        raise UserError(
            f"this run needs about {need / GIB:.1f} GiB per rank ({', '.join(f'{k} {v / GIB:.1f}' for k, v in top)}"
            f" GiB at training.seq_len {t.seq_len}, local_batch_size {t.local_batch_size}), more than the "
            f"{have / GIB:.1f} GiB of {what}; lower those, set activation_checkpoint.mode, or add ranks "
            "(python -m titan.estimate shows the breakdown; --debug.memory_check false skips this check)")


def checkpoint_bytes(num_params: int, optimizer_config, param_bytes: int = 4) -> float:
    """Bytes of one training checkpoint: the fp32 weights and the optimizer's states of each."""
    states = OPTIMIZER_STATES[optimizer_config.name]
    if optimizer_config.name == "SGD" and optimizer_config.momentum == 0:
        states = 0
    return float(num_params * param_bytes * (1 + states))
