"""FlashConv's step as one C call (flash_step.c), built once per machine with the system's C compiler.

A step at D = 64, B = 1 is about a hundred multiply-adds; as tensor ops it costs their dispatch, several
microseconds, which at long L is most of flash's time on a CPU. The library is compiled on first use into
$LCSM_CACHE_DIR/native (about a second) and loaded with ctypes. Without a compiler, `flash_step` returns None and
the engine keeps its tensor path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from lcsm.inference import autotune

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("flash_step.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
CTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled flash_step library, or None (logged once) when it cannot be built here."""
    cc = compiler()
    if cc is None:
        logger.warning("lcsm: no C compiler (cc, gcc or clang, or $CC); flash steps run as tensor ops (slower)")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + f"{cc} {FLAGS} {autotune.machine(torch.device('cpu'))}".encode()).hexdigest()
    path = autotune.cache_file().parent / "native" / f"flash_step-{key[:16]}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
        try:
            subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], check=True, capture_output=True, text=True)
            tmp.replace(path)  # atomic: a concurrent process loads the old library or the new one
        except (OSError, subprocess.CalledProcessError) as e:
            tmp.unlink(missing_ok=True)
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning(f"lcsm: compiling {SOURCE.name} with {cc} failed ({detail.strip().splitlines()[-1]}); "
                           "flash steps run as tensor ops (slower)")
            return None
    return ctypes.CDLL(str(path))


@functools.cache
def _slot_struct(ctype) -> type[ctypes.Structure]:
    pointer = ctypes.POINTER(ctype)
    return type("Slot", (ctypes.Structure,), {"_fields_": [
        ("A", pointer), ("Y", pointer), ("rho", pointer), ("acc", pointer), ("ys", pointer),
        ("b", ctypes.c_int64), ("B", ctypes.c_int64), ("D", ctypes.c_int64), ("L", ctypes.c_int64),
        ("acc_len", ctypes.c_int64)]})


def flash_step(dtype: torch.dtype):
    """The C step for dtype, called as step(slot, t, pending, y_ptr, z_ptr); None if unavailable."""
    lib = library() if dtype in CTYPES else None
    if lib is None:
        return None
    suffix, ctype = CTYPES[dtype]
    step = getattr(lib, f"flash_step_{suffix}")
    step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    step.restype = None
    return step


def slot(A: torch.Tensor, Y: torch.Tensor, rho: torch.Tensor, acc: torch.Tensor, ys: torch.Tensor):
    """A slot's arguments for the C step: A, Y (b, B, D), rho (b, D), acc (D, B, acc_len), ys (D, B, L), all
    contiguous. The caller keeps the tensors alive as long as the returned structure."""
    tensors = (A, Y, rho, acc, ys)
    if not all(t.is_contiguous() and t.device.type == "cpu" and t.dtype == A.dtype for t in tensors):
        raise ValueError("the C flash step needs contiguous CPU tensors of one dtype")
    b, B, D = A.shape
    _, ctype = CTYPES[A.dtype]
    pointers = [ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype)) for t in tensors]
    return _slot_struct(ctype)(*pointers, b, B, D, ys.shape[-1], acc.shape[-1])
