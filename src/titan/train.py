"""`python -m titan.train [--config PATH.toml] [--section.key value ...]`"""

from __future__ import annotations

from titan.builders import check_outputs_are_ours
from titan.config import help_text, parse_args
from titan.estimate.dry_run import main as estimate_main
from titan.tools.cli import entry_point, run
from titan.trainer import Trainer


@entry_point
def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    # --estimate.* options belong to the dry run that comm.mode = "fake" hands the command line to.
    job_config = parse_args(argv, passthrough=("estimate",))
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
    return 0


if __name__ == "__main__":
    run(main)
