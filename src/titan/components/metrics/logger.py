"""Step metrics to the console, metrics.jsonl, tensorboard and Weights & Biases; written by rank 0 only."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from titan.tools.logging import logger

CONSOLE_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"}


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def start_wandb(dump_folder: str, run_name: str, config: dict[str, Any] | None):
    """A Weights & Biases run beside the other sinks; WANDB_PROJECT / WANDB_MODE (e.g. offline) as wandb reads them."""
    try:
        import wandb
    except ImportError:
        raise ValueError("metrics.enable_wandb needs wandb: pip install wandb (or the 'wandb' extra)") from None
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "titan"), name=run_name or None, dir=dump_folder,
                      config=config, resume="allow")


class MetricsLogger:
    def __init__(self, dump_folder: str, enable_jsonl: bool, enable_tensorboard: bool, rank: int,
                 tb_folder: str = "tb", enable_wandb: bool = False, run_name: str = "",
                 run_config: dict[str, Any] | None = None):
        self.is_writer = rank == 0
        self.jsonl = None
        self.tb = None
        self.wandb = None
        if not self.is_writer:
            return
        os.makedirs(dump_folder, exist_ok=True)
        if enable_jsonl:
            # Append: a resumed run continues the same file.
            self.jsonl = open(Path(dump_folder) / "metrics.jsonl", "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(dump_folder) / tb_folder))
        if enable_wandb:
            self.wandb = start_wandb(dump_folder, run_name, run_config)

    @classmethod
    def from_config(cls, job_config, rank: int) -> MetricsLogger:
        m = job_config.metrics
        return cls(job_config.dump_folder, m.enable_jsonl, m.enable_tensorboard, rank, m.save_tb_folder,
                   m.enable_wandb, job_config.job.name, dataclasses.asdict(job_config))

    def log(self, record: dict[str, Any], eta_s: float) -> None:
        if not self.is_writer:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, record["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                           step=record["step"])
        mfu = record.get("mfu")
        extra = "".join(f"  {k} {v:.4f}" for k, v in record.items() if k not in CONSOLE_KEYS and isinstance(v, float))
        logger.info(
            f"step {record['step']:>5}  loss {record['loss']:8.4f}  grad_norm {record['grad_norm']:7.3f}  "
            f"lr {record['lr']:.2e}  tps {record['tps']:>8,.0f}  "
            f"mfu {'n/a' if mfu is None else f'{mfu:5.1f}%'}  mem {record['memory_gib']:.2f}GiB"
            f"{extra}  eta {_fmt_eta(eta_s)}"
        )

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
