"""Engine steps as one C call each (steps.c), built once per machine with the system's C compiler.

- flash: a step at D = 64, B = 1 is about a hundred multiply-adds; as tensor ops it costs their dispatch, which at
  long L is most of flash's time on a CPU.
- decode: block_exit of lcsm.inference.decode (out_proj, the MLP, the next block's norm, in_proj and short conv)
  in one call: at D = 64 its tensor ops cost their dispatch, and AOTInductor's code calls ATen for each matmul.
- lazy: the baseline gets the same treatment, so that the comparison stays fair: at batch 1 its dot product over
  the whole history in one pass over memory, where the tensor path makes four.
The library is compiled on first use into $LCSM_CACHE_DIR/native (about a second): where Python's headers are, as an
extension module (steps_module.c: the cheapest call from Python), else as a plain library loaded with ctypes.
Without a compiler, `available` is False and the engines keep their tensor paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
import sysconfig
from pathlib import Path

import torch

from lcsm.inference import accel
from lcsm.inference.accel import autotune
from titan.tools.native import FLAGS, LIBS, build_once, compiler

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("steps.c")
MODULE_SOURCE = Path(__file__).with_name("steps_module.c")
MODULE = "_lcsm_steps"
CTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}


def python_include() -> str | None:
    """The folder of Python.h for this interpreter, or None (e.g. a system Python without its -dev package)."""
    include = sysconfig.get_paths().get("include")
    return include if include and Path(include, "Python.h").is_file() else None


def build_command(cc: str, out: Path) -> list[str]:
    """How to build the library: the extension module where Python's headers are, else plain steps.c."""
    include = python_include()
    if include is None:
        return [cc, *FLAGS, str(SOURCE), "-o", str(out), *LIBS]
    return [cc, *FLAGS, f"-I{include}", str(MODULE_SOURCE), "-o", str(out), *LIBS]


def library_path(cc: str) -> Path:
    """Where the library built by cc lives: one file per source, compiler, flags, Python and machine."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0] if python_include() else ".so"
    build = f"{build_command(cc, Path('out'))} {sys.version} {autotune.machine(torch.device('cpu'))}"
    key = hashlib.sha256(SOURCE.read_bytes() + MODULE_SOURCE.read_bytes() + build.encode()).hexdigest()
    return autotune.cache_file().parent / "native" / f"steps-{key[:16]}{suffix}"


@functools.cache
def library():
    """The compiled steps: the extension module, or the ctypes library; None (logged once) when neither can be
    built here."""
    cc = compiler()
    if cc is None:
        logger.warning("lcsm: no C compiler (cc, gcc or clang, or $CC); engine steps run as tensor ops (slower)")
        return None
    path = library_path(cc)
    error = build_once(path, lambda out: build_command(cc, out))
    if error is not None:
        logger.warning(f"lcsm: building {SOURCE.name} with {cc} into {path.parent} failed ({error}); "
                       "engine steps run as tensor ops (slower)")
        return None
    try:
        return _load(path)
    except (OSError, ImportError) as e:  # a damaged file, or one built against another C library on a shared home
        logger.warning(f"lcsm: loading {path} failed ({e}); engine steps run as tensor ops (slower); delete it to "
                       "rebuild")
        return None


def _load(path: Path):
    if path.name.endswith(importlib.machinery.EXTENSION_SUFFIXES[0]):
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return ctypes.CDLL(str(path))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the C code serves tensors of this device and dtype here (accelerations on, a CPU, float32 or float64,
    a library)."""
    return accel.enabled() and device.type == "cpu" and dtype in CTYPES and library() is not None


def c_function(name: str, device: torch.device, dtype: torch.dtype, argtypes: list, restype=None):
    """The C function `name` of steps.c for dtype, or None where it cannot be had."""
    if not available(device, dtype):
        return None
    step = getattr(library(), f"{name}_{CTYPES[dtype][0]}")
    if isinstance(step, ctypes._CFuncPtr):  # the extension module's functions take Python ints as they are
        step.argtypes, step.restype = argtypes, restype
    return step


def flash_step(device: torch.device, dtype: torch.dtype):
    """Called as step(slot_address, t, y_ptr, z_ptr); see `slot`."""
    return c_function("flash_step", device, dtype, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                    ctypes.c_void_p])


def lazy_step(device: torch.device, dtype: torch.dtype):
    """Called as step(y_DL_ptr, rho_rev_ptr, D, L, t, y_ptr, z_ptr), at batch 1."""
    return c_function("lazy_step", device, dtype, [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                                                   ctypes.c_void_p, ctypes.c_void_p])


def slot(A: torch.Tensor, Y: torch.Tensor, rho: torch.Tensor, rows: torch.Tensor, filter_DL: torch.Tensor,
         tiles: int):
    """A slot's arguments for the C flash step: A, Y (b, B, D), rho (b, D), rows (D, B, row_len) and the slot's
    filters (D, L), all contiguous; the largest tile size the step does itself (0: none); and its `pending` flag
    (set when prefill begins a block; the step clears it). The caller keeps the tensors alive as long as the
    returned structure."""
    b, B, D = A.shape
    ctype, pointers = _pointers((A, Y, rho, rows, filter_DL), "the C flash step")
    cls = _struct("FlashSlot", ctype, ("A", "Y", "rho", "rows", "filter"),
                  ("b", "B", "D", "L", "row_len", "pending", "tiles"))
    return cls(*pointers, b, B, D, filter_DL.shape[-1], rows.shape[-1], 0, tiles)


def _pointers(tensors: tuple[torch.Tensor, ...], what: str):
    """The C type of the tensors' dtype and a pointer to each one's data (contiguous CPU tensors of one dtype)."""
    if not all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == tensors[0].dtype for t in tensors):
        raise ValueError(f"{what} needs contiguous CPU tensors of one dtype")
    _, ctype = CTYPES[tensors[0].dtype]
    return ctype, [ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype)) for t in tensors]


@functools.cache
def _struct(name: str, ctype, pointers: tuple[str, ...], ints: tuple[str, ...], reals: tuple[str, ...] = ()):
    return type(name, (ctypes.Structure,), {"_fields_": [(p, ctypes.POINTER(ctype)) for p in pointers]
                                            + [(i, ctypes.c_int64) for i in ints] + [(r, ctype) for r in reals]})


def block_exit(device: torch.device, dtype: torch.dtype):
    """Called as exit(args_address, x_ptr, z_ptr, gate_ptr, out_ptr, u_ptr); see `block_exit_args`."""
    return c_function("block_exit", device, dtype, [ctypes.c_void_p] * 6)


EXIT_POINTERS = ("out_w", "out_b", "w1", "w2", "in_w", "in_b", "conv_w", "conv_b", "ring", "scratch")


def block_exit_args(post: tuple[torch.Tensor, ...], entry: tuple[torch.Tensor, ...], ring_BKGD: torch.Tensor,
                    D_eps: float):
    """One call site's arguments: post = (out_w, out_b, w1, w2), entry = (in_w, in_b, conv_w, conv_b) as
    decode.ExitBlock has them, and the ring it moves on. Returns the structure and the scratch buffer, both for
    the caller to keep alive."""
    out_w, _, w1, _ = post
    B, K, G, D = ring_BKGD.shape
    H = w1.shape[1]
    scratch = out_w.new_empty(3 * D + H + G * D)
    ctype, pointers = _pointers((*post, *entry, ring_BKGD, scratch), "the C block_exit")
    cls = _struct("BlockExit", ctype, EXIT_POINTERS, ("B", "D", "H", "C", "K"), ("D_eps",))
    return cls(*pointers, B, D, H, G * D, K, D_eps), scratch


def decode_token(device: torch.device, dtype: torch.dtype):
    """Called as decode(args_address, t, tokens_ptr, logits_ptr) -> 0, or -1 for a token outside the vocabulary;
    see `decode_token_args`."""
    return c_function("decode_token", device, dtype, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                      ctypes.c_void_p], restype=ctypes.c_int32)


DECODE_POINTERS = ("embedding", "sites", "x", "u", "orders", "flash", "lazy_y", "lazy_rho", "embedded", "v", "z",
                   "gate")


def decode_token_args(embedding: torch.Tensor, sites: list[int], x: list[torch.Tensor], u: list[torch.Tensor],
                      orders: list[int], flash: list[int] | None, lazy: list[tuple[int, int]] | None, L: int):
    """The arguments of one decode state's decode_token: the embedding (vocab, D); the addresses of the block_exit
    structures (blocks + 1, the head last); each site's output x (B, D) and each block's short conv output u
    (B, N + 1, D); the blocks' orders; the engine's slots: flash structures' addresses, or lazy's (history,
    filter) addresses; the engine's length L. Returns the structure and what it points into, both for the caller
    to keep alive."""
    B, D = x[0].shape
    scratch = [embedding.new_empty(B, D) for _ in range(4)]
    ctype, tensor_pointers = _pointers((embedding, *x, *u, *scratch), "the C decode step")
    flash, lazy = flash or [], lazy or []
    arrays = [(ctypes.c_void_p * len(sites))(*sites), (ctypes.c_void_p * len(x))(*[t.data_ptr() for t in x]),
              (ctypes.c_void_p * len(u))(*[t.data_ptr() for t in u]), (ctypes.c_int64 * len(orders))(*orders),
              (ctypes.c_void_p * len(flash))(*flash), (ctypes.c_void_p * len(lazy))(*[y for y, _ in lazy]),
              (ctypes.c_void_p * len(lazy))(*[r for _, r in lazy])]
    # An empty array is NULL: the C code tells flash from lazy by it.
    addresses = [ctypes.cast(a, ctypes.POINTER(ctype)) if len(a) else ctypes.POINTER(ctype)() for a in arrays]
    cls = _struct("DecodeToken", ctype, DECODE_POINTERS, ("B", "D", "vocab", "blocks", "L", "timed", "engine_ns"))
    args = cls(tensor_pointers[0], *addresses, *tensor_pointers[-4:], B, D, embedding.shape[0], len(u), L, 0, 0)
    return args, (arrays, scratch)
