"""Writes a HyenaDNA model of ours as a checkpoint folder in the reference's layouts, named and shaped as the
reference's modules name and shape them (read from standalone_hyenadna.py and the -hf port, written out here by hand
so that the loader's own name table is not what the tests check it against)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lcsm.model.hyenadna import HyenaDNA, HyenaDNAArgs


def random_model(args: HyenaDNAArgs, dtype: torch.dtype = torch.float64, seed: int = 0) -> HyenaDNA:
    """Every parameter and buffer random (biases, norms, D, frequencies and features included), the head untied."""
    torch.manual_seed(seed)
    model = HyenaDNA(args).to(dtype)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.add_(torch.randn_like(tensor) * (0.3 if tensor.dim() <= 1 else 0.1))
    return model.eval()


def reference_state(model: HyenaDNA, layout: str, checkpoint_mixer: bool = False,
                    tied_head: bool = False) -> dict[str, torch.Tensor]:
    top = "model.backbone." if layout == "published" else "hyena.backbone."
    out = {top + "embeddings.word_embeddings.weight": model.tok_embeddings.weight,
           top + "ln_f.weight": model.norm.weight, top + "ln_f.bias": model.norm.bias}
    if not tied_head:
        out["model.lm_head.weight" if layout == "published" else "lm_head.weight"] = model.output.weight
    for i, block in enumerate(model.layers.values()):
        layer = f"{top}layers.{i}."
        mixer = layer + ("mixer.layer." if checkpoint_mixer else "mixer.")
        mlp = layer + ("mlp.layer." if checkpoint_mixer else "mlp.")
        m, f = block.mixer, block.mixer.filter
        for name, module in (("norm1", block.norm1), ("norm2", block.norm2)):
            out[f"{layer}{name}.weight"], out[f"{layer}{name}.bias"] = module.weight, module.bias
        for prefix, module in ((mixer + "in_proj", m.in_proj), (mixer + "out_proj", m.out_proj),
                               (mixer + "short_filter", m.short_filter), (mlp + "fc1", block.mlp.fc1),
                               (mlp + "fc2", block.mlp.fc2)):
            out[prefix + ".weight"], out[prefix + ".bias"] = module.weight, module.bias
        fn = mixer + "filter_fn."
        out[fn + "bias"] = f.D
        out[fn + "pos_emb.z"] = f.z[None]  # (1, l_max, emb_dim)
        out[fn + "pos_emb.t"] = f.t[None, :, None]  # (1, l_max, 1)
        out[fn + "modulation.deltas"] = f.deltas[None, None]  # (1, 1, channels)
        for j, linear in enumerate(f.mlp):  # Linear, Sin, Linear, Sin, ..., then the projection
            out[f"{fn}implicit_filter.{2 * j}.weight"] = linear.weight
            out[f"{fn}implicit_filter.{2 * j}.bias"] = linear.bias
            if layout == "published" or j == 0:  # safetensors keeps one copy of the shared activation
                out[f"{fn}implicit_filter.{2 * j + 1}.freq"] = f.freq[None]
        out[f"{fn}implicit_filter.{2 * len(f.mlp)}.weight"] = f.proj.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def reference_config(args: HyenaDNAArgs, layout: str, checkpoint_mixer: bool = False) -> dict:
    if layout == "published":
        layer = {"_name_": "hyena", "emb_dim": args.emb_dim, "filter_order": args.filter_order, "local_order": 3,
                 "l_max": args.l_max, "modulate": args.modulate, "w": args.w, "lr": 6e-4, "wd": 0.0,
                 "lr_pos_emb": 0.0}
        if args.shift != 0.05:
            layer["shift"] = args.shift
        if args.num_inner_mlps != 2:
            layer["num_inner_mlps"] = args.num_inner_mlps
        return {"d_model": args.d_model, "n_layer": args.n_layer, "d_inner": args.d_inner,
                "vocab_size": args.vocab_size, "resid_dropout": 0.0, "embed_dropout": 0.1, "fused_mlp": False,
                "fused_dropout_add_ln": True, "residual_in_fp32": True, "pad_vocab_size_multiple":
                args.pad_vocab_size_multiple, "return_hidden_state": True, "layer_norm_epsilon": args.norm_eps,
                "checkpoint_mixer": checkpoint_mixer, "checkpoint_mlp": checkpoint_mixer, "layer": layer}
    return {"model_type": "hyenadna", "architectures": ["HyenaDNAForCausalLM"], "d_model": args.d_model,
            "n_layer": args.n_layer, "d_inner": args.d_inner, "vocab_size": args.vocab_size,
            "pad_vocab_size_multiple": args.pad_vocab_size_multiple, "max_seq_len": args.l_max,
            "emb_dim": args.emb_dim, "filter_order": args.filter_order, "short_filter_order": 3,
            "num_inner_mlps": args.num_inner_mlps, "hyena_order": 2, "activation_freq": args.w, "use_bias": True,
            "train_freq": True, "layer_norm_epsilon": args.final_norm_eps, "embed_dropout": 0.1,
            "hyena_dropout": 0.0, "hyena_filter_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "float32"}


def write_checkpoint(model: HyenaDNA, folder: Path, layout: str, checkpoint_mixer: bool = False,
                     tied_head: bool = False, hf_format: str = "safetensors") -> Path:
    """config.json and the weights: weights.ckpt (published) or model.safetensors / pytorch_model.bin (-hf)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(reference_config(model.args, layout, checkpoint_mixer)))
    state = reference_state(model, layout, checkpoint_mixer, tied_head)
    if layout == "published":
        torch.save({"state_dict": state, "epoch": 3, "global_step": 1000}, folder / "weights.ckpt")
    elif hf_format == "safetensors":
        from safetensors.torch import save_file

        save_file(state, folder / "model.safetensors")
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder
