"""The Hyena LM trained through titan: `python -m titan.train --config configs/lcsm/hyena_debug.toml`."""

from pathlib import Path

import pytest

from lcsm.model.spec import hyena_flavors, hyena_spec, update_model_args
from tests.titan.conftest import assert_same_run, read_metrics, run_train
from titan.models import get_model_spec

TINY = ["--config", str(Path(__file__).parents[3] / "configs/lcsm/hyena_debug.toml"), "--model.dim", "32",
        "--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
        "false", "--validation.enable", "false", "--lr_scheduler.warmup_steps", "2"]


def train(args, folder, nproc=1):
    run_train([*TINY, *args, "--job.dump_folder", str(folder)], nproc=nproc)
    return read_metrics(folder)


def test_spec_is_registered_by_import():
    assert get_model_spec("hyena", "lcsm.hyena") is hyena_spec
    assert set(hyena_flavors) == {"debug", "153M"}
    big = hyena_flavors["153M"]
    assert (big.dim, big.n_layers) == (864, 18)


def test_update_model_args_takes_vocab_and_covers_seq_len():
    class Tok:
        vocab_size = 777

    class Training:
        seq_len = 4096

    class Job:
        training = Training

    args = update_model_args(hyena_flavors["debug"], Job, Tok)
    assert (args.vocab_size, args.max_seq_len) == (777, 4096)


def test_short_training_run_through_titan_lowers_the_loss(tmp_path):
    records = train(["--training.steps", "25", "--optimizer.lr", "5e-3"], tmp_path)
    assert records[-1]["step"] == 25
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    # Throughput is each step's 8 x 64 tokens over its seconds (the gap between consecutive elapsed_s).
    ratios = sorted(r["tps"] * (r["elapsed_s"] - p["elapsed_s"]) / (8 * 64) for p, r in zip(records[1:], records[2:]))
    assert 0.7 < ratios[len(ratios) // 2] < 1.3, ratios


def test_tensor_parallel_2_matches_one_process(tmp_path):
    common = ["--training.steps", "3", "--training.local_batch_size", "2", "--debug.seed", "7"]
    one = train(common, tmp_path / "one")
    tp2 = train([*common, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                 "1"], tmp_path / "tp2", nproc=2)
    assert_same_run(tp2, one, rtol=1e-4)


@pytest.mark.slow
def test_fsdp2_by_tensor_parallel_2_on_4_ranks_matches_one_process(tmp_path):
    # Global batch 4 either way: one process accumulates two micro-batches of 2, the 2 FSDP ranks take 2 each.
    common = ["--training.steps", "3", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
              "--debug.seed", "7"]
    one = train(common, tmp_path / "one")
    fsdp_tp = train([*common, "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                     "2"], tmp_path / "fsdp2_tp2", nproc=4)
    assert_same_run(fsdp_tp, one, rtol=1e-4)


def test_a_llama_field_on_a_hyena_run_is_one_error_line(tmp_path):
    proc = run_train([*TINY, "--model.rope_theta", "1e4", "--job.dump_folder", str(tmp_path)], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: unknown key model.rope_theta: model hyena has no such field")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
