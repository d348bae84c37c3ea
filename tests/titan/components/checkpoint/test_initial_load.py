"""A run starts from a Hugging Face folder (its architecture, weights and tokenizer) or from the model weights of a
DCP step folder (titan's or TorchTitan's), each mismatch named in one line."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.conftest import TINY
from titan.components.checkpoint.initial_load import initial_checkpoint, load_initial_checkpoint
from titan.components.data.tokenizer import BOS, EOS, hf_folder_tokenizer, llama3_tokenizer_path
from titan.config import parse_args
from titan.models.llama3 import ModelArgs, Transformer
from titan.tools.cli import UserError
from titan.trainer import Trainer

TEXT = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs."] * 40


def write_tokenizer(folder, specials=("<s>", "</s>"), config=None):
    """A small byte-level BPE with special tokens named in tokenizer_config.json (Llama-like by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    config = config or {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny sharded Llama 3.2-style folder (tied, factor-32 RoPE), its tokenizer, and one stray safetensors."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True,
                                   max_position_embeddings=131072, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    (folder / "consolidated.safetensors").write_bytes(b"not the model: never read")
    write_tokenizer(folder)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    return folder, model


def run_config(folder, tmp_path, *extra):
    return parse_args(["--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder),
                       "--checkpoint.initial_load_in_hf", "--model.hf_assets_path", str(folder),
                       "--training.dataset_path", str(folder / "corpus.jsonl"), "--training.seq_len", "32",
                       "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
                       "--metrics.enable_tensorboard", "false", "--metrics.cpu_peak_tflops", "1",
                       "--job.dump_folder", str(tmp_path / "run"), *extra])


def test_a_run_from_an_hf_folder_computes_transformers_logits(hf_folder, tmp_path):
    folder, hf = hf_folder
    trainer = Trainer(run_config(folder, tmp_path))
    assert trainer.model_args.tie_embeddings and trainer.model_args.rope_factor == 32.0
    assert trainer.model_args.vocab_size == 320 and trainer.tokenizer.vocab_size == 300
    inputs, _ = next(iter(trainer.dataloader))
    assert (trainer.tokenizer.bos_id, trainer.tokenizer.eos_id) == (0, 1)  # <s>, </s> from tokenizer_config.json
    assert (inputs == 0).any() and (inputs == 1).any()
    with torch.no_grad():
        got, want = trainer.model(inputs), hf(inputs).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    trainer.close()


def test_a_qwen3_folder_with_its_tokenizer_computes_transformers_logits(tmp_path):
    """Qwen's tokenizer_config.json declares no BOS (null): documents are separated by <|endoftext|> alone."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "qwen3"
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=320, tie_word_embeddings=True,
                                   max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1e6})
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(folder)
    write_tokenizer(folder, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                    {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    trainer = Trainer(run_config(folder, tmp_path, "--model.name", "qwen3"))
    assert trainer.model_args.head_dim == 32 and trainer.model_args.vocab_size == 320
    assert (trainer.tokenizer.bos_id, trainer.tokenizer.eos_id) == (None, 0)
    inputs, _ = next(iter(trainer.dataloader))
    assert (inputs == 0).any() and not ((inputs == 1) | (inputs == 2)).any()
    with torch.no_grad():
        got, want = trainer.model(inputs), hf(inputs).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    trainer.close()


def test_a_folder_of_another_family_is_named(hf_folder, tmp_path):
    folder, _ = hf_folder
    with pytest.raises(UserError, match="model_type 'llama' is not 'qwen3'; set model.name to the folder's family"):
        Trainer(run_config(folder, tmp_path, "--model.name", "qwen3"))


def test_a_flavor_that_disagrees_with_the_folder_is_named(hf_folder, tmp_path):
    folder, _ = hf_folder
    with pytest.raises(ValueError, match=r"hidden_size = 64 but the run's model has model\.dim = 256") as e:
        Trainer(run_config(folder, tmp_path, "--model.flavor", "debug"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"tie_word_embeddings = True .* model\.tie_embeddings = False"):
        Trainer(run_config(folder, tmp_path, "--model.tie_embeddings", "false"))


def test_weights_that_disagree_with_config_json_are_named(hf_folder, tmp_path):
    folder, _ = hf_folder
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape .* the model needs"):
        Trainer(run_config(broken, tmp_path))
    (broken / "model.safetensors.index.json").unlink()
    with pytest.raises(UserError, match="holds neither model.safetensors nor"):
        Trainer(run_config(broken, tmp_path))


def test_meta_tokenizer_model_in_original(tmp_path):
    (tmp_path / "original").mkdir()
    shutil.copy(llama3_tokenizer_path(), tmp_path / "original" / "tokenizer.model")
    tok = hf_folder_tokenizer(tmp_path)
    assert tok.vocab_size == 128256 and tok.encode("Hello world") == [9906, 1917]
    assert tok.bos_id == 128000 and tok.eos_id == 128001 and BOS and EOS


def _trainer(folder, *extra):
    return Trainer(parse_args([*TINY, "--validation.enable", "false", "--job.dump_folder", str(folder), *extra]))


@pytest.fixture(scope="module")
def trained(module_tmp_path):
    """2 steps with a checkpoint after each; the trainer holds step 2's weights."""
    trainer = _trainer(module_tmp_path / "first", "--training.steps", "2", "--checkpoint.enable",
                       "--checkpoint.interval", "1")
    trainer.train()
    yield trainer, module_tmp_path / "first" / "checkpoint" / "step-2"
    trainer.close()


def test_a_run_starts_from_a_dcp_step_folders_weights_at_step_1(trained, tmp_path):
    first, step2 = trained
    second = _trainer(tmp_path, "--training.steps", "1", "--checkpoint.initial_load_path", str(step2))
    assert second.step == 0 and second.optimizers[0].state == {}  # weights only: no optimizer state, no step
    inputs, labels = next(iter(second.spec.build_dataloader(second.config, 0, 1, second.tokenizer, "train")))
    with torch.no_grad():
        want = first.loss_fn(first.model(inputs), labels).item()
    record = second.train()[0]
    second.close()
    assert record["step"] == 1 and record["loss"] == pytest.approx(want, rel=1e-6)


def test_torchtitans_flat_layout_loads_its_model_weights(trained, tmp_path):
    """TorchTitan saves the model's keys at the top level beside its other states (and a freqs_cis buffer)."""
    first, _ = trained
    weights = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    dcp.save({**weights, "freqs_cis": torch.zeros(4, 2), "train_state": {"step": torch.tensor(7)}},
             checkpoint_id=str(tmp_path / "step-7"))
    model = Transformer(first.model_args)
    load_initial_checkpoint([model], *initial_checkpoint(_config(tmp_path / "step-7"), tmp_path / "own"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def _config(path):
    return parse_args([*TINY, "--checkpoint.initial_load_path", str(path)])


def _flat_folder(tmp_path, state):
    dcp.save(state, checkpoint_id=str(tmp_path / "flat"))
    return tmp_path / "flat"


def _hf_like(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def _truncated(step2, tmp_path):
    shutil.copytree(step2, tmp_path / "bad")
    shard = next((tmp_path / "bad").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return tmp_path / "bad"


@pytest.mark.parametrize("where, message", [
    (lambda step2, tmp: tmp / "nowhere", "does not exist; point it at a checkpoint step folder"),
    (lambda step2, tmp: step2.parent, r"is a checkpoint folder: point it at one of its steps, e.g. .*step-2"),
    (_truncated, "bytes, .* were written"),
    (lambda step2, tmp: _hf_like(tmp), r"looks like a Hugging Face folder \(config.json\): add --checkpoint.initial_"),
    (lambda step2, tmp: _flat_folder(tmp, {"w": torch.ones(2)}), r"has no tok_embeddings.weight \(21 of"),
], ids=["missing", "parent", "truncated", "hf", "other-model"])
def test_an_unusable_dcp_folder_is_one_line(trained, tmp_path, where, message):
    first, step2 = trained
    with pytest.raises(UserError, match=message) as e:
        load_initial_checkpoint(first.model_parts, *initial_checkpoint(_config(where(step2, tmp_path)), tmp_path))
    assert "\n" not in str(e.value)


def test_other_shapes_are_named(trained, tmp_path):
    first, step2 = trained
    model = Transformer(ModelArgs(**{**vars(first.model_args), "hidden_dim": 96}))
    with pytest.raises(UserError, match=r"w1.weight has shape \[\d+, 256\] there, the model needs \[96, 256\]"):
        load_initial_checkpoint([model], *initial_checkpoint(_config(step2), tmp_path / "own"))


def test_special_tokens_declared_only_in_tokenizer_config_are_appended(tmp_path):
    # TorchTitan's tests/assets/tokenizer: tokenizer.json has no added tokens, tokenizer_config.json's
    # added_tokens_decoder names BOS/EOS; TorchTitan (and transformers) append them after the vocabulary.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    plain.decoder = decoders.ByteLevel()
    plain.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    plain.save(str(tmp_path / "tokenizer.json"))
    size = plain.get_vocab_size()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "128000": {"content": "<|begin_of_text|>", "special": True},
        "128001": {"content": "<|end_of_text|>", "special": True}}}))
    tok = hf_folder_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (size, size + 1, size + 2)
    assert tok.decode(tok.encode("the cat")) == "the cat"
