"""A decoder family's run args: a flavor or a Hugging Face config.json, then the config's model.* keys, then the
tokenizer's vocabulary and the training sequence length; weights loaded from an HF folder must fit them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from titan.hf import check_same_architecture, family_of, folder_args
from titan.models.common.decoder import DecoderArgs
from titan.tools.cli import UserError


def hf_weights_folder(job_config) -> Path | None:
    """The Hugging Face folder the run's initial weights come from, if any."""
    ckpt = job_config.checkpoint
    return Path(ckpt.initial_load_path) if ckpt.initial_load_path and ckpt.initial_load_in_hf else None


def args_from_folder(model_type: str, job_config) -> DecoderArgs:
    """model.flavor = "hf": the architecture of the HF folder the run loads, else of model.hf_assets_path, whose
    config.json must be of `model_type` (the spec's family)."""
    folder = hf_weights_folder(job_config) or (Path(job_config.model.hf_assets_path)
                                               if job_config.model.hf_assets_path else None)
    if folder is None:
        raise UserError("model.flavor 'hf' takes the architecture from a Hugging Face folder: set "
                         "checkpoint.initial_load_path (with checkpoint.initial_load_in_hf) or model.hf_assets_path")
    return folder_args(folder, model_type)


def update_model_args(args: DecoderArgs, job_config, tokenizer) -> DecoderArgs:
    """The vocabulary is model.vocab_size, else the HF folder's the run loads (or whose architecture it takes),
    else the tokenizer's; the RoPE table covers exactly the training sequence length (context parallel shards it
    with the sequence). Weights from an HF folder must fit: any other field that differs is an error."""
    folder = hf_weights_folder(job_config)
    source = str(folder / "config.json") if folder else ""
    hf_args = folder_args(folder, family_of(args).model_type) if folder else None
    updates = {"max_seq_len": job_config.training.seq_len}
    if "vocab_size" not in job_config.model.args and job_config.model.flavor != "hf":
        updates["vocab_size"] = hf_args.vocab_size if hf_args else tokenizer.vocab_size
    try:
        args = dataclasses.replace(args, **updates)
    except ValueError as e:
        raise UserError(f"model: {e}") from None
    if tokenizer.vocab_size > args.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary only "
                         f"{args.vocab_size}; raise model.vocab_size or use the model's own tokenizer")
    if hf_args is not None:
        check_same_architecture(args, hf_args, source)
    return args
