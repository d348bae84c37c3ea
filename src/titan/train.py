"""`python -m titan.train [--config PATH.toml] [--section.key value ...]`; without --config it runs
configs/titan/debug.toml."""

from __future__ import annotations

import time
from pathlib import Path

from titan.builders import check_outputs_are_ours
from titan.config import JobConfig, help_text, parse_command_line
from titan.estimate.dry_run import main as estimate_main
from titan.tools.cli import entry_point, report_done, run
from titan.trainer import Trainer


@entry_point
def main(argv: list[str]) -> int:
    start = time.perf_counter()
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    # --estimate.* options belong to the dry run that comm.mode = "fake" hands the command line to.
    job_config = parse_command_line(argv, passthrough=("estimate",))
    if job_config.comm.mode == "fake":
        # A dry run: the same parallelize code on a fake process group of the target size, no training.
        return estimate_main(argv)
    check_outputs_are_ours(job_config)
    trainer = Trainer(job_config)
    try:
        if job_config.checkpoint.create_seed_checkpoint:
            trainer.save_seed_checkpoint()
        else:
            trainer.train()
    finally:
        trainer.close()
    what, figure = summary(trainer, job_config)
    report_done(what, time.perf_counter() - start, figure, outputs(job_config))
    return 0


def summary(trainer: Trainer, cfg: JobConfig) -> tuple[str, str]:
    """What the run did and its headline figure: the steps and the loss from first to last logged step."""
    if cfg.checkpoint.create_seed_checkpoint:
        return "seed checkpoint (step 0)", ""
    records = [r for r in trainer.history if "loss" in r]
    if not records:
        return f"nothing to train (already at step {trainer.step} of {cfg.training.steps})", ""
    first, last = records[0], records[-1]
    steps = f"{last['step']} steps" if first["step"] == 1 else f"steps {first['step']}..{last['step']}"
    figure = f"loss {first['loss']:.2f} -> {last['loss']:.2f}"
    val = [r["val_loss"] for r in records if "val_loss" in r]
    return steps, figure + (f" (validation {val[-1]:.2f})" if val else "")


def outputs(cfg: JobConfig) -> str:
    """The dump folder and what the run wrote there; tensorboard's command where it wrote events."""
    folder, m = Path(cfg.dump_folder), cfg.metrics
    if cfg.checkpoint.create_seed_checkpoint:
        return str(folder / cfg.checkpoint.folder / "step-0")
    written = ["config.toml"] + ["metrics.jsonl"] * m.enable_jsonl + [f"{m.save_tb_folder}/"] * m.enable_tensorboard
    written += [f"{cfg.checkpoint.folder}/"] * cfg.checkpoint.enable
    tensorboard = f"; view with: tensorboard --logdir {folder / m.save_tb_folder}" if m.enable_tensorboard else ""
    return f"{folder} ({', '.join(written)}){tensorboard}"


if __name__ == "__main__":
    run(main)
