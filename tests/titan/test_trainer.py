"""The Trainer end to end through `python -m titan.train`: learning, layouts agree with one process, resume.

Layout tolerance: fp32 losses and grad norms agree within rtol 1e-5 (reductions run in another order).
"""

import shutil

import pytest

from tests.titan.conftest import assert_same_run, losses, read_metrics, run_train

RTOL = 1e-5


def test_training_on_the_corpus_lowers_the_loss(tmp_path, tiny_args):
    run_train([*tiny_args, "--training.steps", "40", "--training.local_batch_size", "8",
               "--training.seq_len", "64", "--optimizer.lr", "3e-3", "--metrics.log_freq", "5",
               "--validation.enable", "--validation.freq", "40", "--validation.steps", "2",
               "--metrics.enable_tensorboard", "true", "--metrics.cpu_peak_tflops", "0",  # measured fp32 peak
               "--job.dump_folder", str(tmp_path)])
    records = read_metrics(tmp_path)
    assert records[0]["loss"] > 8.0
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    assert records[-1]["val_loss"] < records[0]["loss"] - 1.5
    for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"):
        assert key in records[-1], key
    # Throughput is the window's tokens over its seconds (5 steps of 8 x 64 tokens between logged steps),
    # TFLOP/s a fixed multiple of it, MFU a fixed fraction of that, memory a plausible resident size.
    for prev, rec in zip(records[1:], records[2:]):
        assert 0.7 < rec["tps"] * (rec["elapsed_s"] - prev["elapsed_s"]) / (5 * 8 * 64) < 1.3
        assert rec["tflops"] / rec["tps"] == pytest.approx(records[1]["tflops"] / records[1]["tps"], rel=1e-9)
        assert rec["mfu"] / rec["tflops"] == pytest.approx(records[1]["mfu"] / records[1]["tflops"], rel=1e-9)
    assert 0 < records[-1]["mfu"] < 100, "fp32 run: MFU is against the fp32 matmul peak, never above it"
    assert 0.05 < records[-1]["memory_gib"] < 24
    assert list((tmp_path / "tb").iterdir()), "tensorboard events expected"


# Every family trains alike on every layout; each model's one-process run is the reference of its layouts.
MODELS = {"llama3": [], "qwen3": ["--model.name", "qwen3"]}
LAYOUTS = {"fsdp2": [], "tp2": ["--parallelism.tensor_parallel_degree", "2"],
           "cp2": ["--parallelism.context_parallel_degree", "2"],
           "pp2": ["--parallelism.pipeline_parallel_degree", "2"]}


@pytest.fixture(scope="module")
def references(module_tmp_path):
    """model -> its one-process run, global batch 4 as two accumulated micro-batches of 2."""
    from tests.titan.conftest import TINY

    cache = {}

    def get(model):
        if model not in cache:
            folder = module_tmp_path / f"single-{model}"
            run_train([*TINY, *MODELS[model], "--training.steps", "3", "--training.global_batch_size", "4",
                       "--job.dump_folder", str(folder)])
            cache[model] = read_metrics(folder)
        return cache[model]

    return get


@pytest.fixture
def reference(references):
    return references("llama3")


# Llama's pipeline schedules have their own tests (tests/titan/distributed/test_pipeline.py).
@pytest.mark.parametrize("model, layout", [(m, lay) for m in MODELS for lay in LAYOUTS
                                           if (m, lay) != ("llama3", "pp2")])
def test_two_ranks_match_one_process(tmp_path, tiny_args, references, model, layout):
    run_train([*tiny_args, *MODELS[model], "--training.steps", "3", "--training.global_batch_size", "4",
               *LAYOUTS[layout], "--job.dump_folder", str(tmp_path)], nproc=2)
    assert_same_run(read_metrics(tmp_path), references(model))


@pytest.mark.slow
def test_fsdp2_tp2_matches_one_process(tmp_path, tiny_args, reference):
    run_train([*tiny_args, "--training.steps", "3", "--training.global_batch_size", "4",
               "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path)], nproc=4)
    assert_same_run(read_metrics(tmp_path), reference)


def test_hsdp_2x2_matches_one_process(tmp_path, tiny_args, reference):
    run_train([*tiny_args, "--training.steps", "3", "--training.local_batch_size", "1",
               "--training.global_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
               "--job.dump_folder", str(tmp_path)], nproc=4)
    assert_same_run(read_metrics(tmp_path), reference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallelism.context_parallel_degree", "2"],
                                    ["--parallelism.context_parallel_degree", "2",
                                     "--parallelism.tensor_parallel_degree", "2"]], ids=["fsdp2xcp2", "tp2xcp2"])
def test_context_parallel_compositions_match_one_process(tmp_path, tiny_args, reference, layout):
    run_train([*tiny_args, "--training.steps", "3", "--training.global_batch_size", "4", *layout,
               "--job.dump_folder", str(tmp_path)], nproc=4)
    assert_same_run(read_metrics(tmp_path), reference)


def test_resume_gives_the_same_losses(tmp_path, tiny_args):
    args = [*tiny_args, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3",
            "--debug.deterministic"]
    full = tmp_path / "full"
    run_train([*args, "--job.dump_folder", str(full)])
    assert sorted(p.name for p in (full / "checkpoint").iterdir()) == ["step-3", "step-6"]
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    run_train([*args, "--job.dump_folder", str(resumed)])
    assert losses(resumed) == losses(full)[3:]


def test_fsdp_checkpoint_resumes_on_one_process(tmp_path, tiny_args):
    args = [*tiny_args, "--training.steps", "4", "--training.global_batch_size", "4", "--checkpoint.enable",
            "--checkpoint.interval", "2"]
    two = tmp_path / "two"
    run_train([*args, "--job.dump_folder", str(two)], nproc=2)
    one = tmp_path / "one"
    shutil.copytree(two / "checkpoint" / "step-2", one / "checkpoint" / "step-2")
    run_train([*args, "--job.dump_folder", str(one)])
    assert losses(one) == pytest.approx(losses(two)[2:], rel=RTOL)


def test_rerun_with_more_steps_continues_and_appends(tmp_path, tiny_args):
    args = [*tiny_args, "--checkpoint.enable", "--checkpoint.interval", "100", "--job.dump_folder", str(tmp_path)]
    run_train([*args, "--training.steps", "2"])
    proc = run_train([*args, "--training.steps", "4"])
    assert "resumed from checkpoint" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_keep_latest_k_prunes(tmp_path, tiny_args):
    run_train([*tiny_args, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "1",
               "--checkpoint.keep_latest_k", "2", "--job.dump_folder", str(tmp_path)])
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-3", "step-4"]
