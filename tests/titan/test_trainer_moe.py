"""MoE families in the real trainer: expert parallel over 2 ranks, and expert x tensor parallel over 4, give the
one-process losses and gradient norms (fp32, 1e-5), metrics.jsonl carries the experts' load, and expert parallel on
a model without experts is one error line."""

import pytest

from tests.titan.conftest import TINY, assert_same_run, read_metrics, run_train

MOE_MODELS = {"qwen3_moe": ["--model.name", "qwen3_moe"], "deepseek_v3": ["--model.name", "deepseek_v3"]}
STEPS = ["--training.steps", "3", "--training.global_batch_size", "4"]


@pytest.mark.parametrize("model", MOE_MODELS)
def test_expert_parallel_2_matches_one_process(tmp_path, model):
    run_train([*TINY, *MOE_MODELS[model], *STEPS, "--job.dump_folder", str(tmp_path / "one")])
    run_train([*TINY, *MOE_MODELS[model], *STEPS, "--parallelism.expert_parallel_degree", "2",
               "--job.dump_folder", str(tmp_path / "ep2")], nproc=2)
    reference, records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ep2")
    assert_same_run(records, reference)
    for got, want in zip(records, reference):
        # 2 x 32 tokens a sequence x k routed copies, counted over both ranks as in one process.
        assert got["moe_tokens_max"] == want["moe_tokens_max"] and got["moe_tokens_min"] == want["moe_tokens_min"]
        assert 1 <= got["moe_imbalance"] == pytest.approx(want["moe_imbalance"])


def test_expert_x_tensor_parallel_matches_one_process(tmp_path):
    """EP 2 x TP 2 on 4 ranks with loss parallel, from a meta model as every run: each TP rank routes its sequence
    shard, dispatches it in its own expert group, and the experts' gradients are averaged over TP after FSDP."""
    model = MOE_MODELS["deepseek_v3"]
    run_train([*TINY, *model, *STEPS, "--job.dump_folder", str(tmp_path / "one")])
    run_train([*TINY, *model, *STEPS, "--parallelism.expert_parallel_degree", "2",
               "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "ep2tp2")], nproc=4)
    reference, records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ep2tp2")
    assert_same_run(records, reference)
    for got, want in zip(records, reference):
        assert got["moe_tokens_max"] == want["moe_tokens_max"] and got["moe_tokens_min"] == want["moe_tokens_min"]


def test_expert_parallel_without_experts_is_one_error_line(tmp_path):
    proc = run_train([*TINY, "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(tmp_path)],
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: parallelism.expert_parallel_degree 2 needs a model with experts" in proc.stderr
