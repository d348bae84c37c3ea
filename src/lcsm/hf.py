"""The public HyenaDNA checkpoints as lcsm models: `lcsm.hf.load(folder) -> HyenaDNA`.

Two layouts, told apart by the files:
- published (LongSafari/hyenadna-*-seqlen): `config.json` holding HyenaDNA's model arguments (d_model, n_layer,
  d_inner, vocab_size, pad_vocab_size_multiple, layer: {l_max, emb_dim, filter_order, w, ...}) and `weights.ckpt`, a
  Lightning-style {"state_dict": {"model.backbone.<...>": tensor, "model.lm_head.weight": tensor}};
- Hugging Face (LongSafari/hyenadna-*-seqlen-hf): `config.json` with model_type "hyenadna" and HyenaConfig's names
  (max_seq_len, hyena_order, short_filter_order, activation_freq, ...) and `model.safetensors` or
  `pytorch_model.bin`, whose names start with "hyena.backbone." and "lm_head.".
Files are read as tensors only (safetensors, or torch.load with weights_only=True): nothing in them runs. A
configuration lcsm cannot compute exactly is refused with one line naming the field.

Where the reference's own codes disagree, lcsm follows its inference code (standalone_hyenadna.py and the -hf
port), which the checkpoints are published with: the filter modulation's shift is 0.05 unless config.json gives
`layer.shift` (the training code's default is 0.0: pass shift=0.0 to load() for that), and fields whose meaning
differs between them (order > 2, a short filter other than 3, a filter without its skip term D, normalized
filters) are refused.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch

from lcsm.model.hyenadna import HyenaDNA, HyenaDNAArgs
from titan.tools.cli import UserError

# Published layout: fields read into HyenaDNAArgs, and fields of training only (dropout, optimizer, kernels).
TRAINING_ONLY = {"resid_dropout", "embed_dropout", "residual_in_fp32", "fused_mlp", "fused_dropout_add_ln",
                 "return_hidden_state", "checkpoint_mixer", "checkpoint_mlp", "initializer_cfg", "use_head",
                 "n_classes", "process_group", "device", "dtype"}
LAYER_TRAINING_ONLY = {"_name_", "d_model", "dropout", "filter_dropout", "lr", "wd", "lr_pos_emb", "fused_fft_conv",
                       "fast_decay_pct", "slow_decay_pct", "target", "modulation_lr", "train_freq", "jit_filter",
                       "fused_bias_fc", "return_state", "channels", "filter_cls", "num_heads", "inner_factor",
                       "num_blocks", "outer_mixing", "post_order_ffn", "activation", "bias", "normalized",
                       "local_order", "short_filter_order"}
"""Layer fields that either do not change the forward pass or are checked to have the value lcsm computes."""
LAYER_REQUIRED_VALUES = {"_name_": "hyena", "num_heads": 1, "inner_factor": 1, "num_blocks": 1, "outer_mixing": False,
                         "post_order_ffn": False, "activation": "id", "bias": True, "normalized": False,
                         "local_order": 3, "short_filter_order": 3, "order": 2}
HF_REQUIRED_VALUES = {"hyena_order": 2, "short_filter_order": 3, "use_bias": True}


def _error(where: str, message: str) -> UserError:
    return UserError(f"{where}: {message}")


def layout(folder: Path) -> str:
    """'published' or 'hf', from the files in the folder."""
    if (folder / "weights.ckpt").is_file():
        return "published"
    if (folder / "model.safetensors").is_file() or (folder / "pytorch_model.bin").is_file():
        return "hf"
    raise UserError(f"{folder} holds neither weights.ckpt (the published HyenaDNA layout) nor model.safetensors or "
                    "pytorch_model.bin (the -hf layout); give a HyenaDNA checkpoint folder")


def _published_args(config: dict, where: str, shift: float | None) -> HyenaDNAArgs:
    known = {"d_model", "n_layer", "d_inner", "vocab_size", "pad_vocab_size_multiple", "layer", "layer_norm_epsilon",
             "attn_layer_idx", "attn_cfg", "max_position_embeddings"}
    unknown = set(config) - known - TRAINING_ONLY
    if unknown:
        raise _error(where, f"{sorted(unknown)[0]} is not a HyenaDNA model argument lcsm knows; remove it or load the "
                     "model with the reference code")
    if config.get("attn_layer_idx") or config.get("attn_cfg"):
        raise _error(where, "attn_layer_idx/attn_cfg: lcsm runs pure-Hyena HyenaDNA, without attention layers")
    if config.get("max_position_embeddings", 0):
        raise _error(where, "max_position_embeddings must be 0 (HyenaDNA has no position embeddings)")
    layer = config.get("layer")
    if not isinstance(layer, dict):
        raise _error(where, "layer must be an object of the Hyena operator's arguments (l_max, emb_dim, ...)")
    known = {"l_max", "order", "filter_order", "emb_dim", "w", "modulate", "shift", "num_inner_mlps"}
    unknown = set(layer) - known - LAYER_TRAINING_ONLY
    if unknown:
        raise _error(where, f"layer.{sorted(unknown)[0]} is not a Hyena operator argument lcsm knows; remove it")
    for key, value in LAYER_REQUIRED_VALUES.items():
        if key in layer and layer[key] != value:
            raise _error(where, f"layer.{key} = {json.dumps(layer[key])}: lcsm computes HyenaDNA as published with "
                         f"{key} = {json.dumps(value)} (the reference's codes disagree on, or lack, the other values)")
    if layer.get("d_model", config.get("d_model")) != config.get("d_model"):
        raise _error(where, f"layer.d_model {layer['d_model']} differs from d_model {config.get('d_model')}")
    for key in ("d_model", "n_layer", "vocab_size"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise _error(where, f"{key} must be a positive integer, got {config.get(key)!r}")
    if not isinstance(layer.get("l_max"), int) or layer["l_max"] < 2:
        raise _error(where, f"layer.l_max must be an integer >= 2 (the filters' length), got {layer.get('l_max')!r}")
    eps = config.get("layer_norm_epsilon", 1e-5)
    return _args(where, d_model=config["d_model"], n_layer=config["n_layer"],
                 d_inner=config.get("d_inner") or 4 * config["d_model"], vocab_size=config["vocab_size"],
                 pad_vocab_size_multiple=config.get("pad_vocab_size_multiple", 1), l_max=layer["l_max"],
                 order=layer.get("order", 2), filter_order=layer.get("filter_order", 64),
                 emb_dim=layer.get("emb_dim", 3), num_inner_mlps=layer.get("num_inner_mlps", 2),
                 w=layer.get("w", 1), modulate=layer.get("modulate", True),
                 shift=layer.get("shift", 0.05) if shift is None else shift, norm_eps=eps, final_norm_eps=eps)


def _hf_args(config: dict, where: str, shift: float | None) -> HyenaDNAArgs:
    if config.get("model_type") not in ("hyenadna", "hyena"):
        raise _error(where, f"model_type {config.get('model_type')!r} is not HyenaDNA's ('hyenadna')")
    for key, value in HF_REQUIRED_VALUES.items():
        if key in config and config[key] != value:
            raise _error(where, f"{key} = {json.dumps(config[key])}: lcsm computes HyenaDNA as published with "
                         f"{key} = {json.dumps(value)}")
    for key in ("d_model", "n_layer", "vocab_size", "max_seq_len"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise _error(where, f"{key} must be a positive integer, got {config.get(key)!r}")
    # The -hf port builds the blocks' LayerNorms with torch's default eps and the final one with layer_norm_epsilon.
    return _args(where, d_model=config["d_model"], n_layer=config["n_layer"],
                 d_inner=config.get("d_inner") or 4 * config["d_model"], vocab_size=config["vocab_size"],
                 pad_vocab_size_multiple=config.get("pad_vocab_size_multiple", 8), l_max=config["max_seq_len"],
                 order=config.get("hyena_order", 2), filter_order=config.get("filter_order", 64),
                 emb_dim=config.get("emb_dim", 3), num_inner_mlps=config.get("num_inner_mlps", 2),
                 w=config.get("activation_freq", 1), modulate=True, shift=0.05 if shift is None else shift,
                 norm_eps=1e-5, final_norm_eps=config.get("layer_norm_epsilon", 1e-5))


def _args(where: str, **fields) -> HyenaDNAArgs:
    if fields["emb_dim"] < 3 or fields["emb_dim"] % 2 == 0:
        raise _error(where, f"emb_dim must be odd and >= 3 (time, cos and sin bands), got {fields['emb_dim']}")
    if min(fields["d_inner"], fields["filter_order"], fields["pad_vocab_size_multiple"]) < 1:
        raise _error(where, "d_inner, filter_order and pad_vocab_size_multiple must be >= 1")
    return HyenaDNAArgs(**fields)


def read_args(folder: str | Path, shift: float | None = None) -> tuple[HyenaDNAArgs, str]:
    """The model arguments in the folder's config.json, and its layout."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder; give a HyenaDNA checkpoint folder (config.json + weights)")
    kind = layout(folder)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing; a HyenaDNA checkpoint folder holds config.json") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold one JSON object")
    read = _published_args if kind == "published" else _hf_args
    return read(config, str(path), shift), kind


def read_tensors(folder: Path, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint's named tensors, read without running any code from the files."""
    if kind == "hf" and (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")
    path = folder / ("weights.ckpt" if kind == "published" else "pytorch_model.bin")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path} cannot be read as tensors only ({first}); lcsm loads no objects that run code: "
                        "save the state_dict alone (a dict of tensors) with torch.save") from None
    state = loaded.get("state_dict", loaded) if kind == "published" and isinstance(loaded, dict) else loaded
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} must hold a dict of tensors" + (' under "state_dict"' if kind == "published" else ""))
    return state


def _reference_names(args: HyenaDNAArgs, kind: str) -> dict[str, str]:
    """Our parameter and buffer names -> the reference's, for the layout."""
    model, head = ("model.backbone.", "model.lm_head.weight") if kind == "published" else ("hyena.backbone.",
                                                                                         "lm_head.weight")
    names = {"tok_embeddings.weight": model + "embeddings.word_embeddings.weight", "output.weight": head,
             "norm.weight": model + "ln_f.weight", "norm.bias": model + "ln_f.bias"}
    n_mlp = 1 + args.num_inner_mlps
    for i in range(args.n_layer):
        ours, theirs = f"layers.{i}.", f"{model}layers.{i}."
        for part in ("norm1", "norm2", "mixer.in_proj", "mixer.out_proj", "mixer.short_filter", "mlp.fc1", "mlp.fc2"):
            for p in ("weight", "bias"):
                names[f"{ours}{part}.{p}"] = f"{theirs}{part}.{p}"
        f, g = ours + "mixer.filter.", theirs + "mixer.filter_fn."
        names.update({f + "z": g + "pos_emb.z", f + "t": g + "pos_emb.t", f + "deltas": g + "modulation.deltas",
                      f + "D": g + "bias", f + "freq": g + "implicit_filter.1.freq",
                      f + "proj.weight": g + f"implicit_filter.{2 * n_mlp}.weight"})
        for j in range(n_mlp):
            for p in ("weight", "bias"):
                names[f"{f}mlp.{j}.{p}"] = g + f"implicit_filter.{2 * j}.{p}"
    return names


def _without_checkpointing_names(name: str) -> str:
    """Models trained with checkpoint_mixer/checkpoint_mlp name their mixers and MLPs '.mixer.layer', '.mlp.layer'."""
    return re.sub(r"\.(mixer|mlp)\.layer\.", r".\1.", name)


def convert(tensors: dict[str, torch.Tensor], model: HyenaDNA, kind: str, where: str) -> dict[str, torch.Tensor]:
    """The reference's tensors as the model's state dict; every tensor must be used, and every one needed present."""
    tensors = {_without_checkpointing_names(k): v for k, v in tensors.items()}
    names = _reference_names(model.args, kind)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    state, used = {}, set()
    for ours, theirs in names.items():
        if ours == "output.weight" and theirs not in tensors:  # a tied head is saved once, as the embedding
            theirs = names["tok_embeddings.weight"]
        if theirs not in tensors:
            raise _error(where, f"the weights lack {theirs} (config.json's n_layer, num_inner_mlps or layout may not "
                         "match them)")
        tensor = tensors[theirs]
        if tensor.numel() != shapes[ours].numel():
            raise _error(where, f"{theirs} has shape {tuple(tensor.shape)} but config.json implies "
                         f"{tuple(shapes[ours])}; the config does not match the weights")
        state[ours] = tensor.reshape(shapes[ours])
        used.add(theirs)
    # The reference shares one sine activation between the filter MLP's layers: every copy of its frequencies must
    # be the one we load.
    freq = re.compile(r"(.*\.implicit_filter\.)(\d+)\.freq$")
    for name, tensor in tensors.items():
        m = freq.match(name)
        if m and name not in used:
            first = tensors.get(m.group(1) + "1.freq")
            if first is None or not torch.equal(first, tensor):
                raise _error(where, f"{name} differs from {m.group(1)}1.freq, but HyenaDNA's filter MLP shares one "
                             "sine activation; the weights are not HyenaDNA's")
            used.add(name)
    unused = sorted(set(tensors) - used)
    if unused:
        raise _error(where, f"{len(unused)} tensor(s) of the weights are not part of HyenaDNA as lcsm builds it from "
                     f"config.json, e.g. {unused[0]}; the config does not match the weights")
    return state


def load(folder: str | Path, dtype: torch.dtype = torch.float32, shift: float | None = None) -> HyenaDNA:
    """A HyenaDNA checkpoint folder (published or -hf layout) as an eval-mode HyenaDNA of the given dtype, its
    weights exactly the checkpoint's. shift: the filter modulation's shift where config.json does not give it
    (default 0.05, as HyenaDNA's inference code)."""
    args, kind = read_args(folder, shift)
    folder = Path(folder)
    with torch.device("meta"):
        model = HyenaDNA(args)
    state = convert(read_tensors(folder, kind), model, kind, str(folder))
    model.load_state_dict(state, assign=True)
    return model.to(dtype).eval()
