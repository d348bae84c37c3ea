"""Bad input to `python -m titan.export`: one `error:` line, exit 2, and the run's files untouched."""

import json

import pytest
import torch

import titan.hf
from tests.titan.conftest import TINY, run_train
from titan.export import main


def error_line(capsys):
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("argv", [[], ["--to-hf"], ["--config", "x.toml"], ["--from-hf", "--config"]])
def test_usage_mistakes_say_what_to_give(capsys, argv):
    assert main(argv) == 2
    assert "give --to-hf OUT_DIR or --from-hf HF_DIR first" in error_line(capsys)


def test_an_existing_file_as_the_target(tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("x")
    assert main(["--to-hf", str(target), "--job.dump_folder", str(tmp_path / "run")]) == 2
    assert f"--to-hf {target} is a file" in error_line(capsys)


def test_garbage_safetensors_names_the_file(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False}))
    (hf / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    assert main(["--from-hf", str(hf), "--model.flavor", "hf", "--training.seq_len", "32",
                 "--job.dump_folder", str(tmp_path / "run")]) == 2
    assert f"{hf / 'model.safetensors'} is not a readable safetensors file" in error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_export_leaves_the_runs_config_alone_even_when_it_fails(tmp_path, capsys):
    run = tmp_path / "run"
    run_train([*TINY, "--training.steps", "1", "--checkpoint.enable", "--job.dump_folder", str(run)])
    before = (run / "config.toml").read_text()
    assert main(["--to-hf", str(tmp_path / "hf"), *TINY, "--job.dump_folder", str(run)]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["--to-hf", str(tmp_path / "hf2"), *TINY, "--model.n_layers", "3", "--job.dump_folder", str(run)]) == 2
    assert "with other dimensions: n_layers 2 (this run 3)" in capsys.readouterr().err
    assert (run / "config.toml").read_text() == before


def test_a_qwen3_run_exports_a_folder_that_transformers_loads_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    args = [*TINY, "--model.name", "qwen3", "--job.dump_folder", str(run)]
    run_train([*args, "--training.steps", "1", "--checkpoint.enable"])
    assert main(["--to-hf", str(tmp_path / "hf"), *args]) == 0
    ours = titan.hf.load(tmp_path / "hf")
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=1e-5)


def test_a_model_without_a_hugging_face_format_is_refused(tmp_path, capsys):
    assert main(["--to-hf", str(tmp_path / "hf"), "--model.name", "hyena", "--model.spec", "lcsm.hyena",
                 "--job.dump_folder", str(tmp_path / "run")]) == 2
    assert "--to-hf: model hyena has no Hugging Face format" in error_line(capsys)


def test_nothing_to_export_is_named_and_leaves_no_folder_behind(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["--to-hf", str(tmp_path / "hf"), *TINY, "--job.dump_folder", str(run)]) == 2
    assert f"no checkpoint to export in {run / 'checkpoint'}" in error_line(capsys)
    assert list(tmp_path.iterdir()) == []
