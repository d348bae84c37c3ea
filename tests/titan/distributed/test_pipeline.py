"""Pipeline parallel: stage splits, rank placement, and every schedule reproducing the one-process run."""

import shutil

import pytest
import torch

from tests.titan.conftest import TINY, assert_same_run, losses, read_metrics, run_train
from titan.compat import torch_at_least
from titan.distributed import pipeline
from titan.distributed.pipeline import split_model, stage_ids_for_rank, stage_layer_ranges
from titan.models.llama3 import ModelArgs, Transformer


def test_even_split_gives_the_remainder_to_middle_stages():
    assert stage_layer_ranges(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]


def test_layers_per_stage_and_split_points():
    assert stage_layer_ranges(7, 2, layers_per_stage=4) == [range(0, 4), range(4, 7)]
    assert stage_layer_ranges(6, 3, split_points=[1, 5]) == [range(0, 1), range(1, 5), range(5, 6)]


@pytest.mark.parametrize("kwargs, fragment", [
    ({"n_layers": 2, "num_stages": 4}, "cannot fill 4 pipeline stages"),
    ({"n_layers": 8, "num_stages": 2, "layers_per_stage": 2}, "does not fit 8 layers"),
    ({"n_layers": 8, "num_stages": 2, "layers_per_stage": 8}, "does not fit 8 layers"),
    ({"n_layers": 8, "num_stages": 3, "split_points": [4]}, "must be 2 increasing layer indices"),
    ({"n_layers": 8, "num_stages": 3, "split_points": [5, 3]}, "must be 2 increasing layer indices"),
])
def test_impossible_splits(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        stage_layer_ranges(**kwargs)


def test_rank_placement_loop_and_v():
    assert [stage_ids_for_rank(r, 4, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank(r, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids_for_rank(r, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]


def test_split_parts_cover_the_model_exactly_once():
    args = ModelArgs(dim=32, n_layers=5, n_heads=4, vocab_size=50, multiple_of=16, max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    ranges = stage_layer_ranges(5, 3)
    parts = split_model(model, [0, 1, 2], ranges)
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert parts[0].output is None and parts[1].tok_embeddings is None and parts[2].tok_embeddings is None
    assert parts[2].output is not None and len(model.layers) == 5


PP_ARGS = [*TINY, "--model.n_layers", "4", "--training.steps", "3", "--training.global_batch_size", "4"]


@pytest.fixture(scope="module")
def four_layer_reference(module_tmp_path):
    folder = module_tmp_path / "pp_ref"
    run_train([*PP_ARGS, "--job.dump_folder", str(folder)])
    return read_metrics(folder)


# CI runs one single-stage, one looped and one V schedule; the rest run with `-m slow`.
ZBV_ON_GLOO = pytest.mark.skipif(not torch_at_least("2.12"), reason="refused on gloo before torch 2.12")
SCHEDULES = ["1F1B", "Interleaved1F1B", pytest.param("ZBVZeroBubble", marks=ZBV_ON_GLOO),
             pytest.param("GPipe", marks=pytest.mark.slow),
             pytest.param("LoopedBFS", marks=pytest.mark.slow),
             pytest.param("InterleavedZeroBubble", marks=pytest.mark.slow)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_schedule_matches_one_process(tmp_path, four_layer_reference, schedule):
    run_train([*PP_ARGS, "--parallelism.pipeline_parallel_degree", "2",
               "--parallelism.pipeline_parallel_schedule", schedule, "--job.dump_folder", str(tmp_path)], nproc=2)
    assert_same_run(read_metrics(tmp_path), four_layer_reference)


@pytest.mark.parametrize("version_ok, device, refused", [(False, "cpu", True), (True, "cpu", False),
                                                          (False, "cuda", False)])
def test_zbv_on_gloo_is_refused_in_one_line_before_torch_2_12(monkeypatch, version_ok, device, refused):
    monkeypatch.setattr(pipeline, "torch_at_least", lambda version: version_ok if version == "2.12" else True)
    pipeline.check_schedule_supported("Interleaved1F1B", torch.device(device))
    if not refused:
        pipeline.check_schedule_supported("ZBVZeroBubble", torch.device(device))
        return
    with pytest.raises(ValueError, match=r"ZBVZeroBubble needs torch >= 2.12 on gloo .*use Interleaved1F1B"):
        pipeline.check_schedule_supported("ZBVZeroBubble", torch.device(device))


@pytest.mark.slow
def test_dualpipev_with_enough_microbatches(tmp_path):
    args = [*TINY, "--model.n_layers", "4", "--training.steps", "2", "--training.local_batch_size", "4"]
    ref = tmp_path / "ref"
    run_train([*args, "--job.dump_folder", str(ref)])
    run_train([*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
               "DualPipeV", "--job.dump_folder", str(tmp_path / "pp")], nproc=2)
    assert_same_run(read_metrics(tmp_path / "pp"), read_metrics(ref))


def test_too_few_microbatches_is_a_clear_error(tmp_path):
    proc = run_train([*PP_ARGS, "--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--job.dump_folder", str(tmp_path)],
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: pipeline schedule DualPipeV with 2 microbatches" in proc.stderr


def test_pp2_tp2_matches_and_its_checkpoint_resumes_on_one_process(tmp_path, four_layer_reference):
    args = [*PP_ARGS, "--checkpoint.enable", "--checkpoint.interval", "2"]
    run_train([*args, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "3d")], nproc=4)
    assert_same_run(read_metrics(tmp_path / "3d"), four_layer_reference)
    one = tmp_path / "one"
    shutil.copytree(tmp_path / "3d" / "checkpoint" / "step-2", one / "checkpoint" / "step-2")
    run_train([*args, "--job.dump_folder", str(one)])
    assert losses(one) == pytest.approx(losses(tmp_path / "3d")[2:], rel=1e-5)


# CI runs the 4-rank layouts (PP with TP is test_pp2_tp2_... above); the 8- and 16-rank ones run with -m slow.
@pytest.mark.parametrize("nproc, layout", [
    pytest.param(8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
                 marks=pytest.mark.slow),
    (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"]),
    pytest.param(16, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.context_parallel_degree", "2"], marks=pytest.mark.slow),
], ids=["3d_fsdp2xtp2xpp2", "pp2xfsdp2", "pp2xcp2", "4d_fsdp2xcp2xtp2xpp2"])
def test_pipeline_with_fsdp_matches_one_process(tmp_path, four_layer_reference, nproc, layout):
    # 16 processes share 2 cores: start-up alone takes minutes.
    run_train([*PP_ARGS, *layout, "--job.dump_folder", str(tmp_path)], nproc=nproc, timeout=max(300, 60 * nproc))
    assert_same_run(read_metrics(tmp_path), four_layer_reference)
