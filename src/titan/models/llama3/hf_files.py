"""Reading and writing a Hugging Face Llama folder's weights: exactly the files its index names.

A folder holds either `model.safetensors` or `model.safetensors.index.json` with shards; other `*.safetensors`
files beside them (adapters, consolidated copies) are not the model and are never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from titan.models.llama3.hf_adapter import from_hf, to_hf
from titan.models.llama3.hf_config import hf_config
from titan.models.llama3.model import ModelArgs, Transformer
from titan.tools.cli import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Shard size of big exports; transformers' own default.
MAX_SHARD_BYTES = 5 * 1024**3


def _open(file: Path):
    """A safetensors file opened for reading; a damaged one is named in one line."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), "pt")
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
        raise UserError(f"{file} is not a readable safetensors file ({type(e).__name__}: "
                        f"{str(e).strip()[:200]}); re-download it") from None


def weight_map(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the file that holds it."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        try:
            mapping = json.loads((folder / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{folder / INDEX} is not a safetensors index (no weight_map)") from None
        files = {name: folder / file for name, file in mapping.items()}
        missing = sorted({str(f) for f in files.values() if not f.is_file()})
        if missing:
            raise UserError(f"{folder / INDEX} names {missing[0]}, which is missing")
        return files
    if (folder / SINGLE).is_file():
        with _open(folder / SINGLE) as f:
            return {name: folder / SINGLE for name in f.keys()}
    raise UserError(f"{folder} holds neither {SINGLE} nor {INDEX}; point at a Hugging Face model folder")


def expected_hf_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    with torch.device("meta"):
        model = Transformer(args)
    return {k: v.shape for k, v in to_hf(model.state_dict(), args).items()}


def load_hf_weights(folder: Path, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model's state dict in titan's names and the files' dtype, every name and shape checked against `args`
    first."""
    files = weight_map(folder)
    expected = expected_hf_shapes(args)
    # A tied model's file may still carry lm_head (a copy of the embedding); RoPE caches are not weights.
    extra = [k for k in files if k not in expected and not k.endswith("rotary_emb.inv_freq")
             and not (args.tie_embeddings and k == "lm_head.weight")]
    missing = [k for k in expected if k not in files]
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model has no place for"
        raise UserError(f"{folder} {what} ({len(missing)} missing, {len(extra)} unexpected tensors); "
                         "its config.json and weights disagree with the run's model")
    tensors = {}
    for file in sorted(set(files[k] for k in expected)):
        with _open(file) as f:
            for name in f.keys():
                if name not in expected:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise UserError(f"{file}: {name} has shape {list(shape)}, the model needs "
                                     f"{list(expected[name])}; config.json and the weights disagree")
                tensors[name] = f.get_tensor(name)
    return from_hf(tensors, args)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_hf(folder: Path, state_dict: dict[str, torch.Tensor], args: ModelArgs, dtype: torch.dtype,
            max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Writes config.json and the weights in `dtype`: one model.safetensors, or shards and their index."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in to_hf(state_dict, args).items()}
    shards = _shards(tensors, max_shard_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for name, shard in zip(names, shards):
        tmp = folder / f".{name}.tmp{os.getpid()}"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / name)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        (folder / INDEX).write_text(json.dumps(index, indent=2))
    config = hf_config(args, str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return [folder / n for n in names]
