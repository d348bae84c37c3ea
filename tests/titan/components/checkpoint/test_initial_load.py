"""A run starts from a Hugging Face folder: its architecture, weights and tokenizer, each mismatch named in one line."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titan.components.data.tokenizer import BOS, EOS, hf_folder_tokenizer, llama3_tokenizer_path  # noqa: E402
from titan.config import parse_args  # noqa: E402
from titan.tools.cli import UserError  # noqa: E402
from titan.trainer import Trainer  # noqa: E402

TEXT = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs."] * 40


def write_tokenizer(folder):
    """A small byte-level BPE with Llama-like special tokens named in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny sharded Llama 3.2-style folder (tied, factor-32 RoPE), its tokenizer, and one stray safetensors."""
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


def test_a_flavor_that_disagrees_with_the_folder_is_named(hf_folder, tmp_path):
    folder, _ = hf_folder
    with pytest.raises(ValueError, match=r"hidden_size = 64 but the run's model has model\.dim = 256") as e:
        Trainer(run_config(folder, tmp_path, "--model.flavor", "debug"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"tie_word_embeddings = True .* model\.tie_embeddings = False"):
        Trainer(run_config(folder, tmp_path, "--model.tie_embeddings", "untied"))


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
