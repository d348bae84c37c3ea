"""`python -m titan.train`: its default config, its summary line, and bad input (one `error:` line on stderr,
exit 2, nothing written)."""

import shutil
from pathlib import Path

import pytest

from tests.titan.conftest import TINY as TINY_ARGS
from tests.titan.conftest import read_metrics, run_train
from titan.config import DEFAULT_CONFIG, parse_args, parse_command_line, to_toml
from titan.train import main

CONFIGS = Path(__file__).parents[2] / "configs" / "titan"


def test_without_config_the_command_runs_the_debug_config():
    assert DEFAULT_CONFIG == (CONFIGS / "debug.toml").resolve()
    debug = parse_args(["--config", str(CONFIGS / "debug.toml")])
    assert parse_command_line([]) == debug and to_toml(parse_command_line([])) == to_toml(debug)
    # the file is the base the overrides apply to, and a file given replaces it
    assert parse_command_line(["--training.steps", "7"]).validation.enable is True
    given = parse_args(["--config", str(CONFIGS / "llama3_8b.toml")])
    assert parse_command_line(["--config", str(CONFIGS / "llama3_8b.toml")]) == given


def test_a_run_ends_with_one_line_saying_what_it_did(tmp_path):
    dump = tmp_path / "o"
    proc = run_train([*TINY_ARGS, "--training.steps", "3", "--validation.enable", "--job.dump_folder", str(dump)])
    first, last = read_metrics(dump)[0], read_metrics(dump)[-1]
    *_, line = proc.stdout.strip().splitlines()
    assert line.startswith("done: 3 steps in "), line
    assert line.endswith(f", loss {first['loss']:.2f} -> {last['loss']:.2f} (validation {last['val_loss']:.2f}), "
                         f"outputs in {dump} (config.toml, metrics.jsonl)"), line


def test_the_default_run_checkpoints_and_rerunning_it_resumes(tmp_path):
    # The debug config checkpoints (the tests' TINY turns it off): every checkpoint.interval steps and at the end.
    assert parse_command_line([]).checkpoint.enable is True
    dump = tmp_path / "o"
    args = [*TINY_ARGS, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(dump)]
    proc = run_train([*args, "--training.steps", "3"])
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-3"]
    assert proc.stdout.strip().splitlines()[-1].endswith(f"outputs in {dump} (config.toml, metrics.jsonl, checkpoint/)")
    proc = run_train([*args, "--training.steps", "4"])
    assert f"resumed from checkpoint {dump / 'checkpoint' / 'step-3'}" in proc.stdout
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]


def assert_clean_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert fragment in lines[0]


def test_exit_code_and_stderr_of_the_real_process(tmp_path):
    proc = run_train(["--training.steps", "ten", "--job.dump_folder", str(tmp_path / "o")], check=False)
    assert_clean_error(proc, "training.steps must be an integer")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--training.steps", "ten"], "training.steps must be an integer"),
        (["--training.nosuch", "1"], "unknown key training.nosuch"),
        (["--training.seq_len", "-5"], "training.seq_len must be > 0"),
        (["--parallelism.tensor_parallel_degree", "2"], "world size 1 is not divisible"),
        (["--model.n_heads", "8", "--model.n_kv_heads", "3"], "not divisible by n_kv_heads"),
        (["--model.name", "gpt5"], "unknown model 'gpt5'"),
        (["--model.name", "hyena", "--model.spec", "nosuch.module"], "cannot import 'nosuch.module'"),
        (["--model.flavor", "7B"], "unknown flavor '7B'"),
        (["--training.dataset_path", "/nonexistent/data"], "does not exist"),
        (["--training.dataset", "some/hub-dataset"], "use --model.tokenizer llama3"),
        (["--float8.recipe", "columnwise"], "float8.recipe must be one of"),
        (["--training.global_batch_size", "3"], "not a multiple of local_batch_size"),
        (["--compile.components", "model,graph"], "compile.components must be a list, each one of 'model', 'loss'"),
        (["--parallelism.enable_async_tensor_parallel", "true", "--compile.enable"],
         "needs CUDA (symmetric memory); on the CPU drop --parallelism.enable_async_tensor_parallel"),
        (["--float8.enable_fsdp_float8_all_gather", "true"], "needs --float8.enable"),
        (["--metrics.comm_stats", "true", "--compile.enable"], "count them in an eager run (--compile.enable false)"),
        (["--float8.enable", "--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"],
         "needs float8.recipe = 'tensorwise'"),
        (["--optimizer.lr", "nan"], "optimizer.lr must be a number, got 'nan'"),
        (["--training.max_norm", "NaN"], "training.max_norm must be a number, got 'NaN'"),
        (["--training.dataset", "wiki_ofline"], "neither the bundled 'wiki_offline' nor a Hugging Face hub id"),
        (["--checkpoint.save_on_signal", "maybe"], "checkpoint.save_on_signal must be true or false"),
    ],
)
def test_user_mistakes(tmp_path, capsys, args, fragment):
    # In-process for speed; the real process's exit path is covered above.
    dump = tmp_path / "out"
    assert main([*args, "--job.dump_folder", str(dump)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not dump.exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--compile.enable"], "needs tensor_parallel_degree > 1"),
        (["--parallelism.tensor_parallel_degree", "2"], "add --compile.enable with 'model' in compile.components"),
        (["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.components", "loss"],
         "add --compile.enable with 'model' in compile.components"),
    ],
)
def test_async_tensor_parallel_needs_tp_and_a_compiled_model(tmp_path, capsys, monkeypatch, args, fragment):
    # As on a CUDA host with 2 ranks; the checks come before any process group or device is touched.
    monkeypatch.setattr("titan.builders.device_type", lambda: "cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--parallelism.enable_async_tensor_parallel", "true", *args,
                 "--job.dump_folder", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


def test_malformed_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = = 3\n")
    assert_clean_error(run_train(["--config", str(bad)], check=False), "is not valid TOML")


def test_empty_data_file(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = run_train(["--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "o")], check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
    assert not (tmp_path / "o").exists()


def test_unwritable_dump_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_train(["--job.dump_folder", str(blocker / "sub")], check=False)
    assert_clean_error(proc, "cannot be written")


def test_resuming_a_checkpoint_of_another_model(tmp_path, tiny_args):
    run_train([*tiny_args, "--training.steps", "1", "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])
    before = (tmp_path / "metrics.jsonl").read_text()
    proc = run_train([*tiny_args, "--model.n_layers", "3", "--training.steps", "2", "--checkpoint.enable",
                      "--job.dump_folder", str(tmp_path)], check=False)
    assert_clean_error(proc, "with other dimensions: n_layers 2 (this run 3)")
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert len(read_metrics(tmp_path)) == 1


def test_help_lists_keys():
    proc = run_train(["--help"])
    assert "--training.steps" in proc.stdout and "--parallelism.data_parallel_shard_degree" in proc.stdout


def test_incomplete_checkpoint_is_never_loaded(tmp_path, tiny_args):
    args = [*tiny_args, "--checkpoint.enable", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path)]
    run_train([*args, "--training.steps", "2"])
    # A crash mid-save leaves a .tmp folder and no manifest: the latest complete step is 2.
    shutil.copytree(tmp_path / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-3.tmp")
    (tmp_path / "checkpoint" / "step-3.tmp" / "titan.json").unlink()
    proc = run_train([*args, "--training.steps", "3"])
    assert f"resumed from checkpoint {tmp_path / 'checkpoint' / 'step-2'} (" in proc.stdout


def assert_one_error_line(capsys, fragment):
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


def test_a_run_that_cannot_fit_in_memory_is_refused_with_the_number(tmp_path, capsys, monkeypatch):
    # The machine's memory is pinned so the verdict does not depend on the host running the test.
    monkeypatch.setattr("titan.estimate.fit.available_bytes", lambda: (16 * 2**30, "available RAM"))
    dump = tmp_path / "out"
    assert main(["--training.seq_len", "100000", "--job.dump_folder", str(dump)]) == 2
    assert_one_error_line(capsys, "this run needs about 86.7 GiB per rank (activations 56.1, logits 30.5 GiB at "
                                  "training.seq_len 100000")
    assert not dump.exists()


def test_a_malformed_fault_spec_is_reported_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TITAN_FAULT", "0:3:explode")
    dump = tmp_path / "out"
    assert main([*TINY_ARGS, "--job.dump_folder", str(dump)]) == 2
    assert_one_error_line(capsys, "TITAN_FAULT item '0:3:explode' must look like RANK:STEP:POINT")
    assert not dump.exists()


@pytest.mark.parametrize("content", [b"", b"\x00\xff\xfe\x80" * 64], ids=["empty", "binary"])
def test_an_unreadable_data_file_says_why(tmp_path, capsys, content):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    assert main(["--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(data) in line
    assert "no non-empty documents" in line or ("cannot read" in line and "(" in line and ": )" not in line)


def test_a_full_checkpoint_disk_is_reported_before_step_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("titan.components.checkpoint.integrity.shutil.disk_usage",
                        lambda p: type("Usage", (), {"free": 1000})())
    dump = tmp_path / "out"
    assert main([*TINY_ARGS, "--checkpoint.enable", "--job.dump_folder", str(dump)]) == 2
    assert_one_error_line(capsys, "has 0.00 GiB free, a checkpoint of this run takes about")
    assert not (dump / "metrics.jsonl").exists() and not (dump / "config.toml").exists()
