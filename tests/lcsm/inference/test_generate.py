import os

import pytest
import torch

from lcsm.inference.decode import new_decode_state
from lcsm.inference.generate import generate, main
from lcsm.model.hyena import HyenaArgs, HyenaLM
from tests.launch import run_module

ARGS = HyenaArgs(dim=8, n_layers=2, vocab_size=64, max_seq_len=40, filter_emb_dim=5, filter_hidden=8)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HyenaLM(ARGS)
    m.init_weights()
    return m


def test_greedy_tokens_identical_across_engines(model):
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    out = {e: generate(model, prompt, 30, e) for e in ("lazy", "eager", "recompute", "flash")}
    out["flash_fft_b1"] = generate(model, prompt, 30, "flash", tau="fft", block=1)
    assert out["lazy"].shape == (2, 35) and torch.equal(out["lazy"][:, :5], prompt)
    for tokens in out.values():
        assert torch.equal(tokens, out["lazy"])


def test_generation_continues_the_parallel_forward(model):
    prompt = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(1))
    tokens = generate(model, prompt, 10)
    assert torch.equal(model(tokens[:, :-1]).argmax(-1)[:, 2:], tokens[:, 3:])


def test_sampling_is_seeded(model):
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a, b = (generate(model, prompt, 8, temperature=1.0, generator=torch.Generator().manual_seed(3)) for _ in "ab")
    assert torch.equal(a, b)


def test_bad_lengths_name_the_fix(model):
    with pytest.raises(ValueError, match="shorten the prompt or generate fewer tokens"):
        generate(model, torch.zeros(1, 30, dtype=torch.long), 12)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"prompt length must be in \[1, 40\]"):
        new_decode_state(model, "flash", 1).prefill(torch.zeros(1, 41, dtype=torch.long))


@pytest.mark.parametrize("argv,message", [(["--engine", "fast"], "--engine must be one of"),
                                          (["--tau", "nope"], "--tau must be one of"),
                                          (["--config", "missing.toml"], "is not a file"),
                                          (["--config", "configs/titan/debug.toml"],
                                           "names llama3/debug; lcsm.generate runs hyena flavors"),
                                          (["--checkpoint", "/nonexistent/step-3"], "is not a folder")])
def test_cli_user_mistakes_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_cli_generates_with_every_engine():
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = run_module("lcsm.generate", ["--engine", "all", "--max-new-tokens", "4"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens identical across lazy, eager, recompute, flash: True" in proc.stdout
    *_, line = proc.stdout.strip().splitlines()
    assert line.startswith("done: 4 tokens with lazy, eager, recompute, flash in ") and "flash " in line, line
    assert line.endswith("ms/token, identical: True, outputs in the text above (no files)"), line


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED_BY_METADATA",))


def test_a_crafted_checkpoint_metadata_is_refused_not_executed(tmp_path, capsys, monkeypatch):
    import pickle

    step = tmp_path / "step-1"
    step.mkdir()
    (step / "titan.json").write_text('{"model": "hyena", "flavor": "debug", "files": {}}')
    (step / ".metadata").write_bytes(pickle.dumps(Payload()))
    # Past the identity check, as a crafted manifest copying the real one would be.
    monkeypatch.setattr("titan.components.checkpoint.reader.check_identity", lambda *args: None)
    monkeypatch.chdir(tmp_path)
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "lcsm", "hyena_debug.toml")
    assert main(["--config", config, "--checkpoint", str(step), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its .metadata refers to posix.system" in err[0] and str(step) in err[0]
    assert not (tmp_path / "PWNED_BY_METADATA").exists()


def test_a_llama_checkpoint_is_named_as_such(tmp_path, capsys):
    step = tmp_path / "step-1"
    step.mkdir()
    (step / "titan.json").write_text('{"model": "llama3", "flavor": "debug", "files": {}}')
    config = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "lcsm", "hyena_debug.toml")
    assert main(["--config", config, "--checkpoint", str(step), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds llama3/debug, this run builds hyena/" in err[0]
