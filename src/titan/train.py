"""`python -m titan.train [--config PATH.toml] [--section.key value ...]`"""

from __future__ import annotations

import os
import sys

from titan.components.checkpoint import CheckpointError
from titan.components.nonfinite import NonFiniteLossError
from titan.config import ConfigError, help_text, parse_args
from titan.distributed.runtime import shutdown
from titan.estimate.dry_run import main as estimate_main
from titan.trainer import Trainer

USER_ERRORS = (ConfigError, CheckpointError, ValueError, FileNotFoundError, NonFiniteLossError)


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        # --estimate.* options belong to the dry run that comm.mode = "fake" hands the command line to.
        job_config = parse_args(argv, passthrough=("estimate",))
        if job_config.comm.mode == "fake":
            # A dry run: the same parallelize code on a fake process group of the target size, no training.
            return estimate_main(argv)
        trainer = Trainer(job_config)
        try:
            if job_config.checkpoint.create_seed_checkpoint:
                trainer.save_seed_checkpoint()
            else:
                trainer.train()
        finally:
            trainer.close()
    except USER_ERRORS as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    try:
        shutdown()
    finally:
        # Gloo worker threads can abort a clean interpreter exit; leave without running finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
