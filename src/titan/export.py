"""Llama 3 weights to and from Hugging Face safetensors.

    python -m titan.export --to-hf OUT_DIR [--config C.toml] [overrides]   # latest checkpoint -> HF folder
    python -m titan.export --from-hf HF_DIR [--config C.toml] [overrides]  # HF folder -> step-0 checkpoint

The config names the model and the checkpoint folder (`job.dump_folder`/`checkpoint.folder`), as for
training; `--from-hf` writes a seed checkpoint that a training run with the same config starts from (a run can
also start from the folder itself: `--checkpoint.initial_load_path HF_DIR --checkpoint.initial_load_in_hf`).
`--to-hf` writes the weights in checkpoint.export_dtype, sharded with an index above 5 GiB.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from titan.components.checkpoint import CheckpointError
from titan.config import ConfigError, parse_args
from titan.config.dtypes import TORCH_DTYPES
from titan.models.llama3.hf_files import save_hf
from titan.trainer import Trainer


def check_outside_dump_folder(out_dir: Path, dump_folder: str) -> None:
    """An export is a separate artifact: inside the run's folder a later resume or cleanup would meet it."""
    out, dump = out_dir.absolute().resolve(), Path(dump_folder).absolute().resolve()
    if out == dump or dump in out.parents:
        raise ValueError(f"--to-hf {out_dir} is inside job.dump_folder {dump_folder}; export to a folder outside it")


def export_to_hf(argv: list[str], out_dir: Path) -> Path:
    config = parse_args([*argv, "--checkpoint.enable", "--metrics.enable_jsonl", "false",
                         "--metrics.enable_tensorboard", "false"])
    if config.model.name != "llama3":
        raise ValueError(f"--to-hf converts llama3 checkpoints, not {config.model.name}")
    check_outside_dump_folder(out_dir, config.dump_folder)
    trainer = Trainer(config)
    if trainer.step == 0:
        raise ValueError(f"no checkpoint to export in {Path(config.dump_folder) / config.checkpoint.folder}")
    save_hf(out_dir, trainer.full_state_dict(), trainer.model_args, TORCH_DTYPES[config.checkpoint.export_dtype])
    return out_dir


def import_from_hf(argv: list[str], hf_dir: Path) -> Path:
    """A step-0 checkpoint of the folder's weights: the run's initial load, saved as a seed checkpoint."""
    config = parse_args([*argv, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                         "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf",
                         "--metrics.enable_jsonl", "false", "--metrics.enable_tensorboard", "false"])
    trainer = Trainer(config)
    trainer.save_seed_checkpoint()
    return Path(config.dump_folder) / config.checkpoint.folder / "step-0"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("--to-hf", "--from-hf") or len(argv) < 2:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    direction, folder, rest = argv[0], Path(argv[1]), argv[2:]
    try:
        out = export_to_hf(rest, folder) if direction == "--to-hf" else import_from_hf(rest, folder)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
