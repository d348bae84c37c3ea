import pytest

from lcsm.inference import autotune


@pytest.fixture(autouse=True, scope="session")
def autotune_cache_in_tmp(tmp_path_factory):
    """Autotuned choices go to a folder of this session, not the user's ~/.cache/lcsm (subprocesses inherit it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LCSM_CACHE_DIR", str(tmp_path_factory.mktemp("lcsm_cache")))
    autotune.forget()
    yield
    mp.undo()
    autotune.forget()
