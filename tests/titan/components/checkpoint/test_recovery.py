"""Checkpoints survive crashes: damaged ones are skipped, nothing non-finite is saved, restarts resume."""

import dataclasses
import random
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.components.checkpoint.test_safe_reader import malicious_metadata
from tests.titan.components.data.test_text import CharTokenizer, local_stream
from tests.titan.conftest import TINY, losses, read_metrics, run_train
from titan.components.checkpoint import CheckpointManager
from titan.components.checkpoint.safe_reader import SafeFileSystemReader, load_metadata
from titan.components.data import StreamingTextLoader
from titan.config import JobConfig, parse_args
from titan.models.llama3 import llama3_spec
from titan.trainer import Trainer

CKPT = [*TINY, "--checkpoint.enable", "--checkpoint.interval", "1"]


@pytest.fixture(scope="module")
def three_steps(module_tmp_path):
    """A run with committed checkpoints at steps 1, 2 and 3."""
    folder = module_tmp_path / "three"
    run_train([*CKPT, "--training.steps", "3", "--job.dump_folder", str(folder)])
    return folder


def damaged_copy(three_steps, tmp_path, damage):
    folder = tmp_path / "run"
    shutil.copytree(three_steps / "checkpoint", folder / "checkpoint")
    damage(folder / "checkpoint" / "step-3")
    return folder


def truncate_shard(step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])


def delete_shard(step_dir):
    next(step_dir.glob("*.distcp")).unlink()


def garble_metadata(step_dir):
    (step_dir / ".metadata").write_bytes(b"\x80\x04not a pickle")


@pytest.mark.parametrize("damage, reason", [
    (truncate_shard, "bytes"), (delete_shard, "is missing"), (garble_metadata, "bad checkpoint metadata"),
], ids=["truncated", "missing", "garbled"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(three_steps, tmp_path, damage, reason):
    folder = damaged_copy(three_steps, tmp_path, damage)
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(folder)])
    warnings = [line for line in proc.stdout.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and reason in warnings[0] and "step-3" in warnings[0]
    assert f"resumed from checkpoint {folder / 'checkpoint' / 'step-2'} (" in proc.stdout
    assert [r["step"] for r in read_metrics(folder)] == [3, 4]
    assert losses(folder) == pytest.approx(losses(three_steps)[2:] + losses(folder)[1:], rel=1e-6)


def test_a_malicious_latest_checkpoint_stops_the_run_instead_of_being_skipped(three_steps, tmp_path):
    """Skipping it would resume from an older step with only a warning, and leave the folder for the next reader."""
    folder = damaged_copy(three_steps, tmp_path, malicious_metadata)
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(folder)], check=False)
    assert proc.returncode == 2 and not list(folder.rglob("pwned"))
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint {folder / 'checkpoint' / 'step-3'}: its "
                                                      ".metadata refers to posix.system")
    assert not (folder / "metrics.jsonl").exists()


def test_kill_during_save_resumes_from_the_previous_checkpoint(tmp_path):
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)], fault="0:3:save",
                     check=False)
    assert proc.returncode != 0
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert names == ["step-1", "step-2", "step-3.tmp"]
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)])
    assert "step-2" in proc.stdout.split("resumed from checkpoint")[1].splitlines()[0]
    assert "removed 1 unfinished checkpoint folder" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1", "step-2", "step-3", "step-4"]


def test_nan_loss_stops_with_the_step_and_saves_nothing_of_it(tmp_path):
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)], fault="0:2:nan",
                     check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: non-finite loss nan") and "at step 2" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_nan_loss_can_skip_the_update(tmp_path):
    reference = tmp_path / "ref"
    run_train([*TINY, "--training.steps", "3", "--job.dump_folder", str(reference)])
    skipped = tmp_path / "skip"
    proc = run_train([*TINY, "--training.steps", "3", "--training.on_nonfinite", "skip",
                      "--job.dump_folder", str(skipped)], fault="0:2:nan", check=False)
    assert proc.returncode == 0 and "step 2: non-finite loss" in proc.stdout
    got = read_metrics(skipped)
    assert got[0]["loss"] == losses(reference)[0]
    assert got[1]["loss"] != got[1]["loss"]  # NaN: logged, never applied


@pytest.fixture(scope="module")
def two_ranks_sync(module_tmp_path):
    """The reference of the async and the elastic tests: 2 ranks, 4 steps, a sync checkpoint after each."""
    folder = module_tmp_path / "two_ranks_sync"
    run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(folder)], nproc=2)
    return folder


def test_async_save_gives_the_same_run_and_complete_checkpoints(tmp_path, two_ranks_sync):
    asyn = tmp_path / "async"
    run_train([*CKPT, "--training.steps", "4", "--checkpoint.async_mode", "async",
               "--job.dump_folder", str(asyn)], nproc=2)
    assert losses(asyn) == losses(two_ranks_sync)
    assert sorted(p.name for p in (asyn / "checkpoint").iterdir()) == ["step-1", "step-2", "step-3", "step-4"]
    resumed = tmp_path / "resumed"
    shutil.copytree(asyn / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_train([*CKPT, "--training.steps", "4", "--training.global_batch_size", "4", "--job.dump_folder", str(resumed)])
    assert losses(resumed) == pytest.approx(losses(two_ranks_sync)[2:], rel=1e-5)


def test_seed_checkpoint_starts_every_layout_from_the_same_weights(tmp_path):
    seeded = [*TINY, "--training.steps", "2", "--training.global_batch_size", "4", "--checkpoint.enable",
              "--debug.full_init", "false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*seeded, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(one)])
    shutil.copytree(one / "checkpoint", two / "checkpoint")
    run_train([*seeded, "--job.dump_folder", str(one)])
    run_train([*seeded, "--job.dump_folder", str(two)], nproc=2)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_seed_checkpoint_needs_one_process(tmp_path):
    proc = run_train([*TINY, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                      "--job.dump_folder", str(tmp_path)], nproc=2, check=False)
    assert "error: checkpoint.create_seed_checkpoint runs on one process" in proc.stderr


def test_model_only_export_in_bf16(tmp_path):
    run_train([*CKPT, "--training.steps", "2", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype",
               "bfloat16", "--job.dump_folder", str(tmp_path)])
    metadata = load_metadata(tmp_path / "checkpoint" / "step-2")
    keys = {k.split(".")[0] for k in metadata.state_dict_metadata}
    assert keys == {"model"}
    name = "model.output.weight"
    state = {name: torch.empty(metadata.state_dict_metadata[name].size, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(tmp_path / "checkpoint" / "step-2")))
    assert torch.isfinite(state[name].float()).all()
    assert metadata.state_dict_metadata[name].properties.dtype == torch.bfloat16


def elastic_run(args, folder, fault):
    """A 2-rank elastic job (one restart allowed) in which `fault` kills a rank once; returns the torchrun
    process and the losses by step, a step replayed after the restart counting with its last value."""
    proc = run_train([*args, "--job.dump_folder", str(folder)], nproc=2, fault=fault, max_restarts=1)
    assert "fault injection: SIGKILL" in proc.stdout + proc.stderr
    by_step = {r["step"]: r["loss"] for r in read_metrics(folder)}
    return proc, [by_step[step] for step in sorted(by_step)]


def test_elastic_restart_after_a_killed_rank_finishes_the_run(tmp_path, two_ranks_sync):
    proc, got = elastic_run([*CKPT, "--training.steps", "4"], tmp_path / "elastic", "1:3:step")
    assert "fault injection: SIGKILL of rank 1 before step 3" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "elastic")] == [1, 2, 3, 4]
    assert got == losses(two_ranks_sync)  # bit-identical: the resume restores every state exactly


def draw_trials(n=5, steps=6, interval=2, rng_seed=2026):
    """Kill-and-resume trials from a fixed RNG: the last kills a rank while it saves, the others before a step."""
    rng = random.Random(rng_seed)
    trials = []
    for i in range(n):
        point = "save" if i == n - 1 else "step"
        step = rng.randrange(interval, steps + 1, interval) if point == "save" else rng.randint(1, steps)
        seed, rank, mode = rng.randrange(1000), rng.randrange(2), rng.choice(["disabled", "async"])
        trials.append(pytest.param(seed, rank, step, point, mode, id=f"seed{seed}-rank{rank}-{point}{step}-{mode}"))
    return trials


@pytest.mark.slow
@pytest.mark.parametrize("seed, rank, step, point, mode", draw_trials())
def test_killed_and_resumed_runs_match_an_uninterrupted_one(tmp_path, seed, rank, step, point, mode):
    args = [*TINY, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.async_mode", mode, "--debug.deterministic", "--debug.seed", str(seed)]
    run_train([*args, "--job.dump_folder", str(tmp_path / "ref")], nproc=2)
    _, got = elastic_run(args, tmp_path / "elastic", f"{rank}:{step}:{point}")
    assert got == losses(tmp_path / "ref")


def test_resumed_run_continues_its_stream_and_its_clock(tmp_path):
    def streaming_loader(config, dp_rank, dp_degree, tokenizer, split):
        training = config.training
        return StreamingTextLoader(local_stream(tmp_path), tokenizer, "text", training.seq_len,
                                   training.local_batch_size, dp_rank, dp_degree)

    spec = dataclasses.replace(llama3_spec, build_tokenizer=lambda config: CharTokenizer(),
                               build_dataloader=streaming_loader)
    args = [*TINY, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--validation.enable", "false"]
    first = Trainer(parse_args([*args, "--job.dump_folder", str(tmp_path / "first")]), model_spec=spec)
    first.train()
    first.close()
    shutil.copytree(tmp_path / "first" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = Trainer(parse_args([*args, "--job.dump_folder", str(tmp_path / "resumed")]), model_spec=spec)
    resumed.train()
    resumed.close()
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in first.history[2:]]
    assert resumed.history[0]["elapsed_s"] >= first.history[1]["elapsed_s"] - 1e-3


def test_train_state_counters_newer_than_the_checkpoint_keep_their_defaults(tmp_path):
    config = JobConfig().checkpoint
    config.enable = True
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    manager = CheckpointManager(tmp_path, config, {"model": "linear"})
    manager.save(1, [model], [optimizer], [scheduler], {"step": 1})
    assert manager.load(1, [model], [optimizer], [scheduler], {"step": 0, "elapsed_ms": 0}) == {"step": 1}
