import json
import subprocess
import sys

import pytest
import torch

from lcsm import hf
from lcsm.inference.decode import new_decode_state
from lcsm.model.hyenadna import HyenaDNAArgs
from tests.lcsm.hyenadna_files import random_model, write_checkpoint
from titan.tools.cli import UserError

# Random HyenaDNA configurations shaped like the published ones (order 2, emb_dim 5, vocab 12 padded to 16), tiny.
ARGS = HyenaDNAArgs(d_model=8, n_layer=3, d_inner=32, l_max=40, filter_order=8, emb_dim=5, w=10.0)
ARGS_HF = HyenaDNAArgs(d_model=6, n_layer=2, d_inner=12, l_max=33, filter_order=4, emb_dim=3, num_inner_mlps=1,
                       final_norm_eps=1e-6)
ENGINES = [("lazy", {}), ("eager", {}), ("recompute", {}), ("flash", {"tau": "fft", "block": 1}), ("flash", {}),
           ("flash", {"native_step": False})]


@pytest.fixture(scope="module", params=["published", "hf"])
def saved(request, tmp_path_factory):
    """(layout, the model of ours written in that layout, the folder)."""
    args = ARGS if request.param == "published" else ARGS_HF
    model = random_model(args)
    return request.param, model, write_checkpoint(model, tmp_path_factory.mktemp(request.param), request.param)


def test_load_gives_the_written_weights_exactly(saved):
    _, model, folder = saved
    loaded = hf.load(folder, dtype=torch.float64)
    assert loaded.args == model.args
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("layout,options", [("published", {"checkpoint_mixer": True}),
                                            ("published", {"tied_head": True}),
                                            ("hf", {"hf_format": "bin", "tied_head": True})])
def test_load_variants(tmp_path, layout, options):
    """Models trained with checkpointed mixers ('.mixer.layer.'), heads saved only as the tied embedding, and
    -hf weights in pytorch_model.bin."""
    model = random_model(ARGS)
    if options.get("tied_head"):
        model.output.weight = model.tok_embeddings.weight
    loaded = hf.load(write_checkpoint(model, tmp_path, layout, **options), dtype=torch.float64)
    tokens = torch.randint(0, 12, (2, ARGS.l_max))
    assert torch.equal(loaded(tokens), model(tokens))


@pytest.mark.parametrize("engine,options", ENGINES)
@pytest.mark.parametrize("P", [1, 5])
def test_online_logits_equal_the_parallel_forward_float64(saved, engine, options, P):
    _, _, folder = saved
    model = hf.load(folder, dtype=torch.float64)
    T = model.args.l_max
    tokens = torch.randint(0, model.args.vocab_size, (2, T), generator=torch.Generator().manual_seed(P))
    state = new_decode_state(model, engine, 2, **options)
    logits = [state.prefill(tokens[:, :P])] + [state.step(tokens[:, t])[:, None] for t in range(P, T)]
    want = model(tokens)
    assert want.shape == (2, T, 16)
    torch.testing.assert_close(torch.cat(logits, 1), want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("engine,options", ENGINES)
def test_online_logits_equal_the_parallel_forward_float32(saved, engine, options):
    _, _, folder = saved
    model = hf.load(folder)
    T = model.args.l_max
    tokens = torch.randint(0, model.args.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    state = new_decode_state(model, engine, 1, **options)
    logits = [state.prefill(tokens[:, :3])] + [state.step(tokens[:, t])[:, None] for t in range(3, T)]
    got, want = torch.cat(logits, 1), model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


def test_the_modulation_shift_follows_the_config_then_the_argument(tmp_path):
    model = random_model(HyenaDNAArgs(**{**ARGS.__dict__, "shift": 0.0}))
    folder = write_checkpoint(model, tmp_path, "published")
    assert hf.load(folder).args.shift == 0.0
    config = json.loads((folder / "config.json").read_text())
    del config["layer"]["shift"]
    (folder / "config.json").write_text(json.dumps(config))
    assert hf.load(folder).args.shift == 0.05
    assert hf.load(folder, shift=0.0).args.shift == 0.0


def _edit(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["layer"].update(order=3), "layer.order = 3"),
    (lambda c: c["layer"].update(local_order=4), "layer.local_order = 4"),
    (lambda c: c["layer"].update(normalized=True), "layer.normalized = true"),
    (lambda c: c.update(attn_layer_idx=[1]), "attn_layer_idx"),
    (lambda c: c.update(mystery=1), "mystery is not a HyenaDNA model argument"),
    (lambda c: c["layer"].update(mystery=1), "layer.mystery"),
    (lambda c: c["layer"].pop("l_max"), "layer.l_max must be an integer"),
    (lambda c: c.update(n_layer=2), "are not part of HyenaDNA"),
    (lambda c: c.update(n_layer=4), "the weights lack model.backbone.layers.3"),
    (lambda c: c.update(d_inner=16), "has shape"),
])
def test_a_config_lcsm_cannot_compute_is_one_error(tmp_path, edit, message):
    folder = write_checkpoint(random_model(ARGS), tmp_path, "published")
    _edit(folder, edit)
    with pytest.raises(UserError, match=message) as e:
        hf.load(folder)
    assert "\n" not in str(e.value)


def test_weights_that_would_run_code_are_refused(tmp_path):
    folder = write_checkpoint(random_model(ARGS), tmp_path, "published")
    torch.save({"state_dict": {}, "hyper_parameters": torch.nn.Linear(1, 1)}, folder / "weights.ckpt")
    with pytest.raises(UserError, match="cannot be read as tensors only"):
        hf.load(folder)


def test_generate_cli_with_hf_checkpoint(saved):
    layout, _, folder = saved
    run = subprocess.run([sys.executable, "-m", "lcsm.generate", "--hf", str(folder), "--prompt", "ACGTTGCA",
                          "--max-new-tokens", "6", "--engine", "all"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "tokens identical across lazy, eager, recompute, flash: True" in run.stdout
    assert "ACGTTGCA" in run.stdout


@pytest.mark.parametrize("argv,message", [(["--hf", "/nonexistent"], "is not a folder"),
                                          (["--hf", "{folder}", "--max-new-tokens", "100"], "exceed"),
                                          (["--hf", "{folder}", "--decode", "native"], "--decode native")])
def test_generate_cli_errors(saved, argv, message):
    _, _, folder = saved
    argv = [a.replace("{folder}", str(folder)) for a in argv]
    run = subprocess.run([sys.executable, "-m", "lcsm.generate", *argv, "--prompt", "ACGT"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("error:") and message in run.stderr and len(run.stderr.splitlines()) == 1
