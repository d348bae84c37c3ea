"""A rank of test_agreement.py: calls built_once in SCENARIO and writes what it got to OUT/rank<r>.json.

    python -m tests.titan.tools.agreement_ranks SCENARIO FOLDER OUT
"""

import datetime
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tests.launch import report_rank
from titan.tools.agreement import built_once
from titan.tools.cli import UserError


def main(scenario: str, folder: Path, out: Path) -> None:
    # A rank left waiting fails the test in seconds instead of hanging until the suite's timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()

    def build(tmp: Path) -> None:
        with (folder / "builds.log").open("a") as log:
            log.write(f"{rank}\n")
        if scenario == "build_fails" and rank == 0:
            raise UserError("the corpus has no documents")
        time.sleep(0.5)  # long enough for the other rank to reach the lock
        tmp.write_text("built")

    where = folder / "cache"  # shared: one build
    if scenario != "shared":  # each rank its own folder, as nodes with node-local caches
        where = folder / f"cache{rank}"
    if scenario == "unwritable" and rank == 1:
        where.write_text("a file where the cache folder would be")
    result = {}
    try:
        path = built_once(lambda: where, "tokens.npy", build)
        result["content"] = path.read_text()
    except UserError as e:
        result["error"] = str(e)
    report_rank(out, result)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
