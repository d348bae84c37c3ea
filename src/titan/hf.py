"""Hugging Face model folders for every LLM family: `load(folder)` builds the titan model of the folder's
`config.json` `model_type` with its weights, `save(model, folder, dtype)` writes a folder transformers loads.

A family registers an `HFFamily` (its config.json fields, the name/layout conversion of its weights, its model
builder); `HF_MODEL_TYPES` names the module that registers each model_type, imported on first use. A folder
holds either `model.safetensors` or `model.safetensors.index.json` with shards; other `*.safetensors` files
beside them (adapters, consolidated copies) are not the model and are never read.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan.tools.cli import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Shard size of big exports; transformers' own default.
MAX_SHARD_BYTES = 5 * 1024**3

# config.json model_type -> the module whose import registers its HFFamily.
HF_MODEL_TYPES = {"llama": "titan.models.llama3", "qwen3": "titan.models.qwen3"}


@dataclass(frozen=True)
class HFFamily:
    """How one family's titan model and a Hugging Face folder correspond."""

    model_type: str
    """config.json's model_type."""
    model_name: str
    """The titan ModelSpec name (model.name) of the family."""
    args_type: type
    """The family's args dataclass; a model's family is found from the type of `model.args`."""
    fields: Mapping[str, tuple[str, str]]
    """args field -> (config.json name, model.* key that sets it), for one-line mismatch messages."""
    args_from_hf: Callable[[dict[str, Any], str], Any]
    """`(config.json dict, its path for messages) -> args`; refuses what the model cannot compute."""
    hf_config: Callable[[Any, str], dict[str, Any]]
    """`(args, dtype name) -> config.json dict`."""
    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    from_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    build_model: Callable[[Any], nn.Module]


_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily) -> HFFamily:
    _FAMILIES[family.model_type] = family
    return family


def family_for(model_type: str, source: str = "config.json") -> HFFamily:
    """The family of a config.json model_type; one line naming the supported ones when there is none."""
    if model_type in HF_MODEL_TYPES:
        importlib.import_module(HF_MODEL_TYPES[model_type])
    if model_type not in _FAMILIES:
        raise UserError(f"{source}: model_type {model_type!r} is not supported; titan reads "
                         f"{', '.join(sorted({*HF_MODEL_TYPES, *_FAMILIES}))}")
    return _FAMILIES[model_type]


def family_of(args: Any) -> HFFamily:
    """The family whose args dataclass `args` is."""
    for model_type in HF_MODEL_TYPES:
        family_for(model_type)
    for family in _FAMILIES.values():
        if type(args) is family.args_type:
            return family
    raise UserError(f"{type(args).__name__} has no Hugging Face format; titan writes "
                     f"{', '.join(sorted(_FAMILIES))} models")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} has no config.json; point at a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def folder_args(folder: Path, model_type: str | None = None) -> Any:
    """The args of the folder's config.json, whose model_type must be `model_type` when given."""
    cfg, source = read_hf_config(folder), str(Path(folder) / "config.json")
    found = cfg.get("model_type", "")
    if model_type is not None and found != model_type:
        raise UserError(f"{source}: model_type {found!r} is not {model_type!r}; set model.name to the folder's "
                         "family or point at a {model_type} folder")
    return family_for(found, source).args_from_hf(cfg, source)


def check_same_architecture(args: Any, hf_args: Any, source: str) -> None:
    """One line naming the first field where the run's model differs from the folder's."""
    for name, (hf_name, key) in family_of(args).fields.items():
        ours, theirs = getattr(args, name), getattr(hf_args, name)
        if name == "n_kv_heads":
            ours, theirs = ours or args.n_heads, theirs or hf_args.n_heads
        if name.startswith("rope_") and name not in ("rope_theta", "rope_scaling") and args.rope_scaling == "none":
            continue
        if ours != theirs:
            raise UserError(f"{source} has {hf_name} = {theirs!r} but the run's model has {key} = {ours!r}; take "
                             "the architecture from the folder with --model.flavor hf, or fix the config")


def rope_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """RoPE args of a config.json: transformers 5 keeps them in `rope_parameters`, older files (the released
    Llama 3.x and Qwen3 folders) in `rope_theta` and `rope_scaling`; both are read."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": "none"}
    if kind != "llama3":
        raise UserError(f"{source}: rope type {kind!r} is not supported; titan knows 'default' and 'llama3'")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if missing:
        raise UserError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    return {
        "rope_theta": float(theta), "rope_scaling": "llama3", "rope_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope["low_freq_factor"]),
        "rope_high_freq_factor": float(rope["high_freq_factor"]),
        # transformers falls back to max_position_embeddings when the original context is not given.
        "rope_original_max_seq_len": int(rope.get("original_max_position_embeddings",
                                                  cfg.get("max_position_embeddings", 8192))),
    }


def rope_parameters(args: Any) -> dict[str, Any]:
    """transformers 5's `rope_parameters` for the args."""
    if args.rope_scaling == "llama3":
        return {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": args.rope_factor,
                "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_seq_len}
    return {"rope_type": "default", "rope_theta": args.rope_theta}


def max_position_embeddings(args: Any) -> int:
    """The context the weights are made for, at least the length they were trained on here."""
    return max(args.max_context_len, args.max_seq_len,
               args.rope_original_max_seq_len if args.rope_scaling == "llama3" else 0)


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


def expected_hf_shapes(args: Any) -> dict[str, torch.Size]:
    family = family_of(args)
    with torch.device("meta"):
        model = family.build_model(args)
    return {k: v.shape for k, v in family.to_hf(model.state_dict(), args).items()}


def load_hf_weights(folder: Path, args: Any) -> dict[str, torch.Tensor]:
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
    return family_of(args).from_hf(tensors, args)


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


def save_state_dict(folder: Path, state_dict: dict[str, torch.Tensor], args: Any, dtype: torch.dtype,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Writes config.json and a full state dict's weights in `dtype`: one model.safetensors, or shards and their
    index."""
    from safetensors.torch import save_file

    family = family_of(args)
    tensors = {k: v.to(dtype).contiguous() for k, v in family.to_hf(state_dict, args).items()}
    shards = _shards(tensors, max_shard_bytes)
    folder = Path(folder)
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
    config = family.hf_config(args, str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return [folder / n for n in names]


def load(folder: str | Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The titan model of a Hugging Face folder, its weights loaded (in `dtype`, else the files'), in eval mode;
    `model(tokens_BT)` gives logits (B, T, vocab)."""
    folder = Path(folder)
    args = folder_args(folder)
    # The RoPE table covers the context the weights are made for.
    args = dataclasses.replace(args, max_seq_len=args.max_context_len)
    state = load_hf_weights(folder, args)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    with torch.device("meta"):
        model = family_of(args).build_model(args)
    model.load_state_dict(state, assign=True)
    model.init_buffers(torch.device("cpu"))
    return model.eval()


def save(model: nn.Module, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
         max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Writes `model` (a titan model of a family with a Hugging Face format) as a folder that transformers'
    `*ForCausalLM.from_pretrained` loads with no missing or unexpected keys; returns the weight files."""
    return save_state_dict(Path(folder), model.state_dict(), model.args, dtype, max_shard_bytes)
