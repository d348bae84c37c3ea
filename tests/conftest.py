import os
import shutil

import pytest

from titan.tools.native import compiler

# Tests share two cores with other test processes: one intra-op thread per process keeps runs predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
