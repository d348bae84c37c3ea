import ctypes
import importlib.machinery
import logging
import math
import subprocess
import types

import pytest
import torch

from lcsm.inference.accel import native
from lcsm.inference.engines import build_engine
from lcsm.model.fftconv import fft_causal_conv
from tests.lcsm.inference.test_engines import run


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """A cache folder of its own and no library loaded yet, so that the next engine builds (or fails to build) it."""
    monkeypatch.setenv("LCSM_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("block, P", [(1, 0), (8, 0), (8, 13), (64, 1), (16, 100)])
def test_c_step_equals_the_tensor_ops_and_the_convolution(dtype, atol, block, P):
    gen = torch.Generator().manual_seed(block + P)
    G, B, D, L = 3, 2, 5, 150
    rho = torch.randn(G, D, L, generator=gen).to(dtype)
    y = torch.randn(G, B, D, L, generator=gen).to(dtype)
    in_c = build_engine("flash", rho, B, tau="fft", block=block, native_step=True)
    as_tensor_ops = build_engine("flash", rho, B, tau="fft", block=block, native_step=False)
    assert in_c.c_step is not None and as_tensor_ops.c_step is None
    z = run(in_c, y, P)
    torch.testing.assert_close(z, run(as_tensor_ops, y, P), rtol=0, atol=atol)
    torch.testing.assert_close(z.double(), fft_causal_conv(y.double(), rho[:, None].double()), rtol=0, atol=10 * atol)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("P", [0, 7])
def test_lazy_c_step_at_batch_1_equals_the_tensor_ops(dtype, atol, P):
    gen = torch.Generator().manual_seed(P)
    rho, y = torch.randn(2, 6, 90, generator=gen).to(dtype), torch.randn(2, 1, 6, 90, generator=gen).to(dtype)
    in_c = build_engine("lazy", rho, 1, native_step=True)
    assert in_c.c_step is not None and build_engine("lazy", rho, 1, native_step=False).c_step is None
    assert build_engine("lazy", rho, 2, native_step=True).c_step is None  # the tensor path is faster at B > 1
    torch.testing.assert_close(run(in_c, y, P), run(build_engine("lazy", rho, 1, native_step=False), y, P),
                               rtol=0, atol=atol)


@pytest.mark.parametrize("name, B", [("lazy", 1), ("flash", 3)])
def test_c_step_takes_strided_inputs_and_its_outputs_are_distinct_tensors(name, B):
    rho, y_LDB = torch.randn(1, 4, 40), torch.randn(40, 4, B)  # y_LDB[t].T is a (B, 4) view with strides (1, B)
    engine = build_engine(name, rho, B, native_step=True, **({"tau": "fft", "block": 8} if name == "flash" else {}))
    outputs = [engine.step(y_LDB[t].T) for t in range(40)]
    assert len({z.data_ptr() for z in outputs}) == 40
    torch.testing.assert_close(torch.stack(outputs, -1), fft_causal_conv(y_LDB.permute(2, 1, 0), rho[0]),
                               rtol=1e-4, atol=1e-4)


@pytest.fixture(params=[True, False], ids=["extension_module", "ctypes_without_python_headers"])
def headers(request, fresh_library, monkeypatch):
    """Whether the library is built as the extension module (Python's headers found) or as a plain ctypes one."""
    if native.compiler() is None or (request.param and native.python_include() is None):
        pytest.skip("no C compiler or no Python headers here")
    if not request.param:
        monkeypatch.setattr(native, "python_include", lambda: None)
    return request.param


def test_both_loaders_give_the_tensor_ops_results(fresh_library, headers):
    rho, y = torch.randn(2, 3, 70, dtype=torch.float64), torch.randn(2, 1, 3, 70, dtype=torch.float64)
    for name, options in [("flash", {"tau": "fft", "block": 8}), ("lazy", {})]:
        in_c = build_engine(name, rho, 1, native_step=True, **options)
        torch.testing.assert_close(run(in_c, y, 5), run(build_engine(name, rho, 1, native_step=False, **options), y, 5),
                                   rtol=0, atol=1e-12)
    (built,) = (fresh_library / "native").glob("steps-*.so")
    assert built.name.endswith(importlib.machinery.EXTENSION_SUFFIXES[0]) == headers
    assert isinstance(native.library(), ctypes.CDLL) != headers


def test_the_extension_module_refuses_wrong_arguments_in_one_line():
    if not isinstance(native.library(), types.ModuleType):
        pytest.skip("no extension module here")
    with pytest.raises(TypeError, match="expected 4 int arguments, got 2"):
        native.library().flash_step_f32(0, 1)
    with pytest.raises(TypeError):
        native.library().lazy_step_f64(0, 0, 1, 1, 0, "not an address", 0)


def test_the_float32_erf_of_the_decode_step_is_within_4e_7_of_the_exact_one(headers):
    """block_exit_f32's gelu uses a rational erf that vectorizes; libm's erff does not."""
    library = native.library()
    if not headers:
        library.erf_f32_array.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    x = torch.cat([torch.linspace(-6, 6, 100_001), torch.tensor([0.0, -0.0, 1e-30, 3.9999, 4.0, 1e30, -1e30])])
    y = torch.empty_like(x)
    library.erf_f32_array(x.data_ptr(), y.data_ptr(), x.numel())
    exact = torch.tensor([math.erf(v) for v in x.double().tolist()], dtype=torch.float64)
    assert (y.double() - exact).abs().max().item() < 4e-7
    assert y.abs().max().item() <= 1 and torch.equal(torch.sign(y), torch.sign(x))


def test_library_is_built_once_into_the_cache_folder(fresh_library):
    build_engine("flash", torch.randn(1, 2, 8), 1, native_step=True)
    (built,) = (fresh_library / "native").glob("steps-*.so")
    native.library.cache_clear()
    stamp = built.stat().st_mtime_ns
    build_engine("flash", torch.randn(1, 2, 8), 1, native_step=True)
    assert built.stat().st_mtime_ns == stamp and not list((fresh_library / "native").glob("*.tmp.so"))


@pytest.mark.parametrize("cc", [None, "/bin/false"], ids=["no_compiler", "failing_compiler"])
def test_without_a_working_compiler_flash_falls_back_to_tensor_ops(fresh_library, monkeypatch, caplog, cc):
    monkeypatch.setattr(native, "compiler", lambda: cc)
    with caplog.at_level(logging.WARNING, logger="lcsm.inference.accel.native"):
        engine = build_engine("flash", torch.randn(1, 2, 8, dtype=torch.float64), 1)
    assert engine.c_step is None and engine.block == 16
    assert "engine steps run as tensor ops" in caplog.text
    assert build_engine("lazy", torch.randn(1, 2, 8), 1).c_step is None
    assert not list(fresh_library.glob("native/*"))
    with pytest.raises(ValueError, match="native_step=True needs float32 or float64 on a CPU and a C compiler"):
        build_engine("flash", torch.randn(1, 2, 8), 1, native_step=True)


def test_an_unwritable_or_damaged_cache_falls_back_with_a_warning(fresh_library, caplog):
    blocker = fresh_library / "native"
    blocker.write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING, logger="lcsm.inference.accel.native"):
        assert build_engine("flash", torch.randn(1, 2, 8), 1).c_step is None
    assert "failed" in caplog.text and "engine steps run as tensor ops" in caplog.text
    blocker.unlink()
    damaged = native.library_path(native.compiler())
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a shared library")
    native.library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lcsm.inference.accel.native"):
        assert build_engine("lazy", torch.randn(1, 2, 8), 1).c_step is None
    assert f"loading {damaged} failed" in caplog.text and "delete it to rebuild" in caplog.text


def test_c_step_refuses_dtypes_it_has_no_code_for():
    assert build_engine("flash", torch.randn(1, 2, 8, dtype=torch.bfloat16), 1).c_step is None
    with pytest.raises(ValueError, match="native_step=True needs float32 or float64"):
        build_engine("flash", torch.randn(1, 2, 8, dtype=torch.bfloat16), 1, native_step=True)


def test_source_compiles_without_warnings(tmp_path, headers):
    cc = native.compiler()
    command = native.build_command(cc, tmp_path / "x.so")
    proc = subprocess.run([command[0], "-Wall", "-Wextra", "-Werror", *command[1:]], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
