"""Llama 3 weights to and from Hugging Face safetensors.

    python -m titan.export --to-hf OUT_DIR [--config C.toml] [overrides]   # latest checkpoint -> HF folder
    python -m titan.export --from-hf HF_DIR [--config C.toml] [overrides]  # HF folder -> step-0 checkpoint

The config names the model and the checkpoint folder (`job.dump_folder`/`checkpoint.folder`), as for
training; `--from-hf` writes a seed checkpoint that a training run with the same config starts from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from titan.config import parse_args
from titan.models.llama3.hf_adapter import from_hf, hf_config, to_hf
from titan.tools.cli import UserError, entry_point, run
from titan.trainer import Trainer


def export_to_hf(argv: list[str], out_dir: Path) -> Path:
    from safetensors.torch import save_file

    config = parse_args([*argv, "--checkpoint.enable", "--metrics.enable_jsonl", "false",
                         "--metrics.enable_tensorboard", "false"])
    if config.model.name != "llama3":
        raise UserError(f"--to-hf converts llama3 checkpoints, not {config.model.name}")
    check_target(out_dir)
    trainer = Trainer(config)
    if trainer.step == 0:
        raise UserError(f"no checkpoint to export in {Path(config.dump_folder) / config.checkpoint.folder}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(trainer.full_state_dict(), trainer.model_args)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(trainer.model_args), indent=1))
    return out_dir


def import_from_hf(argv: list[str], hf_dir: Path) -> Path:
    from safetensors.torch import load_file

    if not hf_dir.is_dir():
        raise UserError(f"--from-hf {hf_dir} is not a folder; give a Hugging Face model folder")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{hf_dir} holds no .safetensors files")
    hf_tensors = {}
    for f in files:
        try:
            hf_tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
            raise UserError(f"{f} is not a readable safetensors file ({type(e).__name__}: "
                            f"{str(e).strip()[:200]}); re-download it") from None
    config = parse_args([*argv, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                         "--metrics.enable_jsonl", "false", "--metrics.enable_tensorboard", "false"])
    probe = Trainer(config)
    state = {k: v.float() for k, v in from_hf(hf_tensors, probe.model_args).items()}
    expected = set(probe.model.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise UserError(f"{hf_dir} does not match {config.model.name}/{config.model.flavor}: "
                         f"missing {missing}, unexpected {extra}")
    trainer = Trainer(config, initial_state_dict=state)
    trainer.save_seed_checkpoint()
    return Path(config.dump_folder) / config.checkpoint.folder / "step-0"


def check_target(out_dir: Path) -> None:
    """The export folder can be created and written, before the checkpoint is read."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--to-hf {out_dir} is a file; give a folder to write config.json and model.safetensors to")
    probe = out_dir.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(f"--to-hf {out_dir} cannot be created ({probe} is not a writable folder); give another path")


@entry_point
def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if not argv or argv[0] not in ("--to-hf", "--from-hf") or len(argv) < 2 or argv[1].startswith("--"):
        raise UserError("give --to-hf OUT_DIR or --from-hf HF_DIR first, then --config and overrides (see --help)")
    direction, folder, rest = argv[0], Path(argv[1]), argv[2:]
    out = export_to_hf(rest, folder) if direction == "--to-hf" else import_from_hf(rest, folder)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
