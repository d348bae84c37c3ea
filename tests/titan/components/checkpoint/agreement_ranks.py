"""A rank of test_agreement.py: saves a linear model at steps 1 and 2 from two ranks, makes rank 1 alone see the
folder differently (SCENARIO), resumes, and writes what it loaded (or the error it raised) to OUT/rank<r>.json.

    python -m tests.titan.components.checkpoint.agreement_ranks FOLDER SCENARIO OUT
"""

import datetime
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.launch import report_rank
from tests.titan.components.checkpoint.test_integrity import manager
from tests.titan.components.checkpoint.test_manager import trained_linear
from titan.components.checkpoint import CheckpointError, integrity
from titan.components.checkpoint import manager as manager_module

REAL_DIGEST = integrity.file_digest
REAL_METADATA = manager_module.load_metadata


def hide_latest(folder: Path) -> list[int]:
    """A listing that lags: step 2 is not there yet."""
    return [1] if folder.is_dir() else []


def changed_digest(path: Path, *args) -> str:
    """Shards of step 2 read back other bytes than were written."""
    return "0" * 16 if path.parent.name == "step-2" else REAL_DIGEST(path, *args)


def unreadable_metadata(path: Path):
    if path.name == "step-2":
        raise OSError(f"[Errno 5] Input/output error: '{path / '.metadata'}'")
    return REAL_METADATA(path)


SCENARIOS = {
    "listing": (manager_module, "complete_steps", hide_latest),
    "shard": (integrity, "file_digest", changed_digest),
    "metadata": (manager_module, "load_metadata", unreadable_metadata),
}


def main(folder: Path, scenario: str, out: Path) -> None:
    # A rank left waiting fails the test in seconds instead of hanging until the suite's timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    model, opt, sched = trained_linear()
    ckpt = manager(folder)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save(step, [model], [opt], [sched], {"step": step})
    name, explicit = scenario.removesuffix("_step2"), scenario.endswith("_step2")
    if rank == 1:
        module, attribute, replacement = SCENARIOS[name]
        setattr(module, attribute, replacement)
    warnings: list[str] = []
    logging.getLogger("titan").addHandler(type("H", (logging.Handler,), {
        "emit": lambda self, r: warnings.append(r.getMessage()) if r.levelno == logging.WARNING else None})())
    model, opt, sched = trained_linear()
    result: dict = {"warnings": warnings}
    try:
        state = manager(folder, load_step=2 if explicit else -1).load_latest([model], [opt], [sched], {"step": 0})
        result.update(step=state["step"], weight=float(model.weight[0, 0]))
    except CheckpointError as e:
        result["error"] = str(e)
    report_rank(out, result)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
