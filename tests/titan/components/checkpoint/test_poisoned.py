"""No file of a checkpoint folder runs code, whoever wrote it: both hostile kinds (poison.py), fed to every reader
of checkpoints (a resumed run, checkpoint.initial_load_path, titan.export, lcsm.generate), leave no marker file
and stop the command with one `error:` line naming the folder. Each payload ran on the code before the fix."""

import shutil

import pytest

from tests.titan.components.checkpoint.poison import poison_bytes_entry, poison_metadata
from tests.titan.conftest import TINY, run_train

POISONS = {"metadata": poison_metadata, "bytes_entry": poison_bytes_entry}
HYENA = ["--config", "configs/lcsm/hyena_debug.toml", "--model.n_layers", "1", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--validation.enable", "false", "--metrics.enable_tensorboard", "false"]


@pytest.fixture(scope="module")
def trained(module_tmp_path):
    """A one-step llama3 run and a one-step hyena run, each with a checkpoint at step 1."""
    run_train([*TINY, "--training.steps", "1", "--checkpoint.enable", "--job.dump_folder",
               str(module_tmp_path / "llama")])
    run_train([*HYENA, "--training.steps", "1", "--checkpoint.enable", "--job.dump_folder",
               str(module_tmp_path / "hyena")])
    return module_tmp_path


READERS = {
    "resume": ("llama", "titan.train", lambda d, step, tmp: [*TINY, "--training.steps", "2", "--checkpoint.enable",
                                                             "--job.dump_folder", str(d)]),
    "initial_load": ("llama", "titan.train", lambda d, step, tmp: [
        *TINY, "--training.steps", "1", "--job.dump_folder", str(tmp / "fresh"),
        "--checkpoint.initial_load_path", str(step)]),
    "export": ("llama", "titan.export", lambda d, step, tmp: ["--to-hf", str(tmp / "hf"), *TINY,
                                                              "--job.dump_folder", str(d)]),
    "generate": ("hyena", "lcsm.generate", lambda d, step, tmp: [*HYENA, "--checkpoint", str(step),
                                                                 "--max-new-tokens", "2"]),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", POISONS)
def test_a_poisoned_checkpoint_runs_nothing_and_is_named_in_one_error_line(trained, tmp_path, kind, reader):
    model, module, argv = READERS[reader]
    dump = tmp_path / "run"
    shutil.copytree(trained / model, dump)
    step = dump / "checkpoint" / "step-1"
    marker = tmp_path / "MARKER"
    POISONS[kind](step, marker)
    proc = run_train(argv(dump, step, tmp_path), module=module, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert not marker.exists(), f"the payload ran under {reader}"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and str(step) in errors[0], proc.stderr[-3000:]
    assert not (tmp_path / "hf").exists()
