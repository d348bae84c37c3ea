"""What the Trainer builds before step 1: model args from flavor and overrides, the batch layout, the checks
that refuse a run early, and a materialized model equal to the one a single process initializes."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.titan.conftest import TINY, run_train
from titan.builders import (
    batch_layout,
    build_model_parts,
    check_layout,
    check_outputs_are_ours,
    check_supported,
    full_initial_state_dict,
    resolve_model_args,
    split_for_pipeline,
    stand_in_model_args,
    warn_if_bf16_is_slow,
)
from titan.config import parse_args
from titan.config.job_config import Training
from titan.distributed import ParallelDims
from titan.models import get_model_spec
from titan.tools.cli import UserError


def test_model_args_are_the_flavor_with_overrides_and_the_tokenizer_vocabulary():
    spec = get_model_spec("llama3")
    cfg = parse_args(["--model.flavor", "debug", "--model.n_layers", "3", "--training.seq_len", "48"])
    args = resolve_model_args(spec, cfg, None, SimpleNamespace(vocab_size=123))
    expected = dataclasses.replace(spec.flavors["debug"], n_layers=3, vocab_size=123, max_seq_len=48)
    assert args == expected


def test_an_unknown_flavor_names_the_known_ones():
    cfg = parse_args(["--model.flavor", "huge"])
    with pytest.raises(ValueError, match="model.flavor: unknown flavor 'huge' of llama3; known: debug"):
        resolve_model_args(get_model_spec("llama3"), cfg, None, SimpleNamespace(vocab_size=10))


@pytest.mark.parametrize("local, global_, dp, expected", [(2, -1, 4, (8, 1)), (2, 16, 4, (16, 2)), (3, 12, 2, (12, 2))])
def test_batch_layout_gives_the_global_batch_and_the_accumulation_steps(local, global_, dp, expected):
    assert batch_layout(Training(local_batch_size=local, global_batch_size=global_), dp) == expected


def test_a_global_batch_that_the_ranks_cannot_split_is_refused():
    with pytest.raises(ValueError, match="global_batch_size 10 is not a multiple of local_batch_size 2 x "
                                         "data-parallel degree 4"):
        batch_layout(Training(local_batch_size=2, global_batch_size=10), 4)


@pytest.mark.parametrize("argv, world, message", [
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"], 2,
     r"seq_len 30 must be divisible by 2 x context_parallel_degree \(4\)"),
    (["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "30"], 4,
     r"seq_len 30 must be divisible by context_parallel_degree x tensor_parallel_degree = 4"),
    (["--parallelism.tensor_parallel_degree", "8"], 8, "tensor_parallel_degree 8 must divide n_heads 16 and "
                                                       "n_kv_heads 4"),
    (["--parallelism.tensor_parallel_degree", "2", "--model.tie_embeddings", "true"], 2, "tied embeddings"),
    (["--parallelism.pipeline_parallel_degree", "2", "--model.n_layers", "1"], 2, "stage"),
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"], 2,
     "local_batch_size 8 is not a multiple of parallelism.pipeline_parallel_microbatch_size 3"),
    (["--training.global_batch_size", "12"], 8, "global_batch_size 12 is not a multiple of local_batch_size 8"),
], ids=["cp-seq", "tp-seq", "tp-heads", "tied-tp", "pp-layers", "pp-microbatch", "global-batch"])
def test_the_layout_rules_refuse_in_one_line(argv, world, message):
    cfg = parse_args(argv)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    spec = get_model_spec("llama3")
    with pytest.raises(ValueError, match=message) as e:
        check_layout(cfg, dims, spec, stand_in_model_args(spec, cfg))
    assert "\n" not in str(e.value)


def test_a_model_without_pipeline_hooks_is_not_pipelined():
    cfg = parse_args(["--parallelism.pipeline_parallel_degree", "2"])
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with pytest.raises(ValueError, match="model mlp cannot be pipelined"):
        split_for_pipeline(nn.Sequential(nn.Linear(2, 2)), "mlp", dims, cfg.parallelism)


def test_one_process_builds_exactly_the_weights_of_a_plain_seeded_init():
    cfg = parse_args([*TINY, "--model.flavor", "debug"])
    spec = get_model_spec("llama3")
    args = resolve_model_args(spec, cfg, None, SimpleNamespace(vocab_size=64))
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    dims.build_mesh("cpu")
    built = build_model_parts(spec, args, cfg, dims, torch.device("cpu"), 0, 1, None)
    reference = full_initial_state_dict(spec, args, cfg.debug.seed)
    got = built.parts[0].state_dict()
    assert set(got) == set(reference) and built.placement is None
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    assert built.num_params == sum(v.numel() for v in reference.values())


@pytest.mark.parametrize("bf16_units, precision, warned", [(False, "bfloat16", True), (True, "bfloat16", False),
                                                           (False, "float32", False)])
def test_bf16_on_a_cpu_without_bf16_units_is_flagged(monkeypatch, caplog, bf16_units, precision, warned):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cfg = parse_args(["--training.mixed_precision_param", precision])
    with caplog.at_level(logging.WARNING, logger="titan"):
        warn_if_bf16_is_slow(torch.device("cpu"), cfg)
    assert any("--training.mixed_precision_param float32" in r.getMessage() for r in caplog.records) == warned


def old_run(folder):
    """What a finished run without checkpoints leaves: its metrics and a tensorboard file."""
    (folder / "tb").mkdir(parents=True)
    (folder / "tb" / "events.out.tfevents.1.host").write_bytes(b"old")
    (folder / "metrics.jsonl").write_text('{"step": 300, "loss": 2.0}\n')


def test_a_new_run_in_another_runs_folder_is_refused_before_writing(tmp_path):
    old_run(tmp_path)
    proc = run_train([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path)], check=False)
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0] == (
        f"error: job.dump_folder {tmp_path} holds another run's metrics.jsonl and tb and no checkpoint to resume "
        "from; pass --job.dump_folder with a new folder, or --job.overwrite to replace that run's metrics")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 300, "loss": 2.0}\n'
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["events.out.tfevents.1.host", "metrics.jsonl", "tb"]


def test_job_overwrite_replaces_the_other_runs_metrics(tmp_path):
    old_run(tmp_path)
    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--job.overwrite"])
    check_outputs_are_ours(cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_resumes_or_writes_no_metrics_is_not_checked(tmp_path):
    old_run(tmp_path)
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    for name in ("titan.json", ".metadata"):
        (tmp_path / "checkpoint" / "step-2" / name).write_text("{}")
    check_outputs_are_ours(parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]))
    check_outputs_are_ours(parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--metrics.enable_jsonl", "false"]))
    with pytest.raises(UserError, match="holds another run's metrics.jsonl and tb"):
        check_outputs_are_ours(parse_args([*TINY, "--job.dump_folder", str(tmp_path)]))
    assert (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_validation_under_a_v_shaped_pipeline_schedule_is_refused_in_one_line(schedule):
    # torch's V-shaped schedules assert in eval(); the debug config turns validation on by default.
    cfg = parse_args(["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                      schedule, "--validation.enable", "true"])
    with pytest.raises(UserError, match=f"validation with pipeline_parallel_schedule {schedule}.*"
                                        "--validation.enable false") as e:
        check_supported(ParallelDims.from_config(cfg.parallelism, 2), cfg)
    assert "\n" not in str(e.value)
