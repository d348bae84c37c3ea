"""A titan LLM's weights to and from a Hugging Face folder (any family titan.hf knows: llama3, qwen3, ...).

    python -m titan.export --to-hf OUT_DIR [--config C.toml] [overrides]   # latest checkpoint -> HF folder
    python -m titan.export --from-hf HF_DIR [--config C.toml] [overrides]  # HF folder -> step-0 checkpoint

The config names the model and the checkpoint folder (`job.dump_folder`/`checkpoint.folder`), as for
training; `--from-hf` writes a seed checkpoint that a training run with the same config starts from (a run can
also start from the folder itself: `--checkpoint.initial_load_path HF_DIR --checkpoint.initial_load_in_hf`).
`--to-hf` writes the weights in checkpoint.export_dtype, sharded with an index above 5 GiB.
"""

from __future__ import annotations

import time
from pathlib import Path

from titan.components.checkpoint import complete_steps
from titan.config import parse_command_line
from titan.config.dtypes import TORCH_DTYPES
from titan.hf import save_state_dict
from titan.models import get_model_spec
from titan.tools.cli import UserError, check_writable, entry_point, report_done, run
from titan.trainer import Trainer


def check_target(out_dir: Path, dump_folder: str) -> None:
    """The export folder can be written, and is a separate artifact: inside the run's folder a later resume or
    cleanup would meet it. Checked before the checkpoint is read."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--to-hf {out_dir} is a file; give a folder to write config.json and model.safetensors to")
    check_writable(out_dir, "--to-hf", "give another path")
    out, dump = out_dir.absolute().resolve(), Path(dump_folder).absolute().resolve()
    if out == dump or dump in out.parents:
        raise UserError(f"--to-hf {out_dir} is inside job.dump_folder {dump_folder}; export to a folder outside it")


def export_to_hf(argv: list[str], out_dir: Path) -> Path:
    config = parse_command_line([*argv, "--checkpoint.enable", "--metrics.enable_jsonl", "false",
                         "--metrics.enable_tensorboard", "false"])
    if get_model_spec(config.model.name, config.model.spec).load_hf_weights is None:
        raise UserError(f"--to-hf: model {config.model.name} has no Hugging Face format")
    check_target(out_dir, config.dump_folder)
    folder = Path(config.dump_folder) / config.checkpoint.folder
    if not complete_steps(folder):  # before the Trainer, which would create the dump folder
        raise UserError(f"no checkpoint to export in {folder}; give the --config and --job.dump_folder of a run "
                        "that saved one (checkpoint.enable)")
    trainer = Trainer(config)
    if trainer.step == 0:
        raise UserError(f"no checkpoint to export in {Path(config.dump_folder) / config.checkpoint.folder}")
    dtype = TORCH_DTYPES[config.checkpoint.export_dtype]
    save_state_dict(out_dir, trainer.full_state_dict(), trainer.model_args, dtype)
    return out_dir


def import_from_hf(argv: list[str], hf_dir: Path) -> Path:
    """A step-0 checkpoint of the folder's weights: the run's initial load, saved as a seed checkpoint."""
    if not hf_dir.is_dir():
        raise UserError(f"--from-hf {hf_dir} is not a folder; give a Hugging Face model folder")
    config = parse_command_line([*argv, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                         "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf",
                         "--metrics.enable_jsonl", "false", "--metrics.enable_tensorboard", "false"])
    trainer = Trainer(config)
    trainer.save_seed_checkpoint()
    return Path(config.dump_folder) / config.checkpoint.folder / "step-0"


@entry_point
def main(argv: list[str]) -> int:
    start = time.perf_counter()
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or argv[0] not in ("--to-hf", "--from-hf") or len(argv) < 2 or argv[1].startswith("--"):
        raise UserError("give --to-hf OUT_DIR or --from-hf HF_DIR first, then --config and overrides (see --help)")
    direction, folder, rest = argv[0], Path(argv[1]), argv[2:]
    out = export_to_hf(rest, folder) if direction == "--to-hf" else import_from_hf(rest, folder)
    what = "export to Hugging Face" if direction == "--to-hf" else f"import of {folder} as a seed checkpoint"
    files = " (config.json, safetensors)" if direction == "--to-hf" else ""
    report_done(what, time.perf_counter() - start, "", f"{out}{files}")
    return 0


if __name__ == "__main__":
    run(main)
