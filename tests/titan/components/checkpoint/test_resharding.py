"""A checkpoint saved on one layout resumes on another with the next unseen data and the same losses."""

import shutil

import pytest

from tests.titan.conftest import TINY, losses, run_train

ARGS = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", "--checkpoint.enable",
        "--checkpoint.interval", "2"]


@pytest.fixture(scope="module")
def dp2_run(module_tmp_path):
    folder = module_tmp_path / "dp2"
    run_train([*ARGS, "--job.dump_folder", str(folder)], nproc=2)
    return folder


@pytest.mark.parametrize("nproc, layout", [
    (4, ["--training.local_batch_size", "1"]),
    (2, ["--parallelism.tensor_parallel_degree", "2"]),
], ids=["dp2_to_dp4", "fsdp2_to_tp2"])
def test_resume_on_another_layout(tmp_path, dp2_run, nproc, layout):
    shutil.copytree(dp2_run / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    proc = run_train([*ARGS, *layout, "--job.dump_folder", str(tmp_path)], nproc=nproc)
    assert f"resumed from checkpoint {tmp_path / 'checkpoint' / 'step-2'} (" in proc.stdout
    assert losses(tmp_path) == pytest.approx(losses(dp2_run)[2:], rel=1e-5)
