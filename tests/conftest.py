import getpass
import multiprocessing.util
import os
import shutil
import tempfile

import pytest

from titan.tools.native import compiler

# Tests share two cores with other test processes: one intra-op thread per process keeps runs predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def session_tempdir(tmp_path_factory):
    """The suite's temporary folder for this process and every process it starts: torchrun's `torchelastic_*`
    folders, wandb's media folders and torch's error files land under pytest's base folder, which pytest prunes,
    instead of piling up in /tmp. Inductor's cache keeps its usual place so compiled kernels survive between runs,
    and multiprocessing's own folder too: its exit handler removes it after pytest has removed this one."""
    multiprocessing.util.get_temp_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    path = str(tmp_path_factory.mktemp("tmp"))
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    yield path
    tempfile.tempdir = saved[1]
    if saved[0] is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = saved[0]


needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler here ($CC, cc, gcc or clang): the "
                                    "torch ops run instead, as the no-compiler tests check")


@pytest.fixture(scope="module")
def module_tmp_path(tmp_path_factory, request):
    """A folder shared by one module's tests, removed when the module is done: checkpoints of several runs would
    otherwise stay on disk for the whole session (gigabytes over the suite)."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_is_plot(path, min_width: int = 400, min_height: int = 250) -> None:
    """A real picture: a PNG that decodes, of a readable size, with something drawn on it (not one flat colour)."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert width >= min_width and height >= min_height, f"{path}: {width}x{height} px"
    assert image[..., :3].std() > 0.02, f"{path} is blank"
