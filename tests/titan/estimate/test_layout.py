"""The estimator's view of the layout: the trainer's pipeline stage split."""

import pytest

from tests.titan.estimate.test_dry_run import _config
from titan.estimate.dry_run import Hardware, estimate

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")


def test_stage_split_is_the_trainers():
    """Even, with the remainder on middle stages (the ends hold embedding and output), or at the split points."""
    even = estimate(_config("llama3_405b_3d_est", ["--model.n_layers", "20"]), Hardware())
    assert [len(r["layers"][0]) for r in even["ranks"]] == [2, 3, 3, 3, 3, 2, 2, 2]
    points = ",".join(f"layers.{i}" for i in range(1, 8))
    split = estimate(_config("llama3_405b_3d_est", ["--model.n_layers", "20",
                                                   "--parallelism.pipeline_parallel_split_points", points]), Hardware())
    assert [len(r["layers"][0]) for r in split["ranks"]] == [1, 1, 1, 1, 1, 1, 1, 13]
