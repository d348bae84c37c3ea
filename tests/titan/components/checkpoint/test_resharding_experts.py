"""A checkpoint of an MoE model saved at one expert-parallel degree resumes at another (and without expert parallel,
from EP x FSDP and EP x TP) with the uninterrupted run's losses (fp32, 1e-5): the routed experts and their AdamW
states are saved whole, and so are DeepSeek-V3's selection biases, which a fast bias update makes steer the routing."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.conftest import TINY, losses, run_train
from titan.components.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner, load_metadata

ARGS = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", "--checkpoint.enable",
        "--checkpoint.interval", "2"]
# 0.05 a step moves the biases past the routers' score gaps within the two steps before the checkpoint.
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.bias_update_rate", "0.05"]
QWEN3_MOE = ["--model.name", "qwen3_moe"]
EXPERTS = 8  # the debug flavor


def _resume(tmp_path, saved, args, nproc):
    shutil.copytree(saved / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    proc = run_train([*args, "--job.dump_folder", str(tmp_path)], nproc=nproc)
    assert f"resumed from checkpoint {tmp_path / 'checkpoint' / 'step-2'} (" in proc.stdout
    return losses(tmp_path)


@pytest.fixture(scope="module")
def deepseek_ep2_run(module_tmp_path):
    folder = module_tmp_path / "deepseek_ep2"
    run_train([*ARGS, *DEEPSEEK, "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(folder)],
              nproc=2)
    return folder


def test_experts_and_selection_biases_are_saved_whole(deepseek_ep2_run):
    path = deepseek_ep2_run / "checkpoint" / "step-2"
    sizes = {k: tuple(v.size) for k, v in load_metadata(path).state_dict_metadata.items() if hasattr(v, "size")}
    assert sizes["model.layers.1.moe.experts.w1"][0] == EXPERTS
    assert sizes["optimizer.state.layers.1.moe.experts.w1.exp_avg_sq"] == sizes["model.layers.1.moe.experts.w1"]
    biases = {k: torch.zeros(EXPERTS) for k in sizes if k.endswith("router.expert_bias")}
    assert len(biases) == 1  # TINY: 2 layers, the first dense
    dcp.load(biases, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    assert all(b.abs().max() >= 0.05 for b in biases.values())  # moved by the bias updates


@pytest.mark.parametrize("nproc, layout", [
    (4, ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4"]),
    (2, []),
], ids=["ep2_to_ep4", "ep2_to_fsdp2"])
def test_deepseek_v3_resumes_at_another_expert_parallel_degree(tmp_path, deepseek_ep2_run, nproc, layout):
    got = _resume(tmp_path, deepseek_ep2_run, [*ARGS, *DEEPSEEK, *layout], nproc)
    assert got == pytest.approx(losses(deepseek_ep2_run)[2:], rel=1e-5)


def test_qwen3_moe_saved_at_ep2_x_fsdp2_resumes_in_one_process(tmp_path):
    # 2 experts top-1: each rank computes 1 expert, which FSDP splits by rows over its 2 shards.
    model = [*QWEN3_MOE, "--model.num_experts", "2", "--model.top_k", "1"]
    saved = tmp_path / "ep2_fsdp2"
    run_train([*ARGS, *model, "--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
               "--job.dump_folder", str(saved)], nproc=4)
    # One sequence a micro-batch, as on each rank: the balance loss is taken over the tokens one forward routes.
    got = _resume(tmp_path / "one", saved, [*ARGS, *model, "--training.local_batch_size", "1"], 1)
    assert got == pytest.approx(losses(saved)[2:], rel=1e-5)


def test_deepseek_v3_saved_at_ep2_x_tp2_resumes_in_one_process(tmp_path):
    # The expert group is the 2 TP ranks: each saves its 4 of the 8 experts, which one process loads whole.
    saved = tmp_path / "ep2_tp2"
    run_train([*ARGS, *DEEPSEEK, "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
               "2", "--job.dump_folder", str(saved)], nproc=2)
    got = _resume(tmp_path / "one", saved, [*ARGS, *DEEPSEEK], 1)
    assert got == pytest.approx(losses(saved)[2:], rel=1e-5)
