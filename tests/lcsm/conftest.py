import pytest
import torch

from lcsm.inference.accel import autotune
from lcsm.model.hyena import HyenaArgs, HyenaLM

# A Hyena LM small enough for exact float64 comparisons in milliseconds.
TINY_ARGS = HyenaArgs(dim=8, n_layers=2, vocab_size=32, max_seq_len=24, filter_emb_dim=5, filter_hidden=8)


@pytest.fixture(autouse=True, scope="session")
def autotune_cache_in_tmp(tmp_path_factory):
    """Autotuned choices go to a folder of this session, not the user's ~/.cache/lcsm (subprocesses inherit it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LCSM_CACHE_DIR", str(tmp_path_factory.mktemp("lcsm_cache")))
    autotune.forget()
    yield
    mp.undo()
    autotune.forget()


def tiny_hyena() -> HyenaLM:
    """TINY_ARGS in float64, seeded."""
    torch.manual_seed(0)
    model = HyenaLM(TINY_ARGS).double()
    model.init_weights()
    return model
