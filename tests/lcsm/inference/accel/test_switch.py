"""LCSM_ACCEL=0: every acceleration off, the plain torch path everywhere, still exact."""

import pytest
import torch

from lcsm.inference.accel import autotune, native
from lcsm.inference.decode import default_decode, new_decode_state
from lcsm.inference.engines import build_engine
from lcsm.inference.tau import triton_available
from tests.lcsm.conftest import TINY_ARGS as ARGS
from tests.lcsm.conftest import tiny_hyena


@pytest.fixture
def plain(monkeypatch):
    monkeypatch.setenv("LCSM_ACCEL", "0")


def test_no_c_steps_no_timing_no_triton(plain):
    rho = torch.randn(2, 4, 32, dtype=torch.float64)
    assert not native.available(torch.device("cpu"), torch.float64)
    assert build_engine("flash", rho, 1).c_step is None and build_engine("lazy", rho, 1).c_step is None
    timed = []
    assert autotune.choose(torch.device("cpu"), "never timed", {"a": lambda: timed.append(1), "b": list}) == "a"
    assert timed == []
    assert not triton_available(torch.device("cpu"))
    with pytest.raises(ValueError, match="native_step=True needs"):
        build_engine("flash", rho, 1, native_step=True)


def test_decoding_is_eager_and_exact(plain):
    model = tiny_hyena()
    assert default_decode(model) == "eager"
    with pytest.raises(ValueError, match="LCSM_ACCEL=0"):
        new_decode_state(model, "flash", 1, decode="native")
    tokens = torch.randint(0, ARGS.vocab_size, (1, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    state = new_decode_state(model, "flash", 1)
    logits = [state.prefill(tokens[:, :3])] + [state.step(tokens[:, t])[:, None] for t in range(3, ARGS.max_seq_len)]
    torch.testing.assert_close(torch.cat(logits, 1), model(tokens), rtol=0, atol=1e-10)
