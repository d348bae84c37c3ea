"""C code for CPU hot paths, built once per machine with the system's C compiler into a cache folder.

The packages that train through titan keep their own sources and fall back to torch ops where nothing can be
built; this module only finds the compiler, names the machine, and builds a file atomically.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

# -fno-trapping-math lets clamps vectorize, -fopenmp-simd the `#pragma omp simd` reductions (no threads: the
# library never links OpenMP's runtime); nothing here reads floating-point exception flags.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp-simd", "-shared", "-fPIC",
         "-std=c11"]
LIBS = ["-lm"]  # after the source: a linker with --as-needed drops libraries named before their use


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.cache
def processor() -> str:
    """The CPU's model name: code built with -march=native is only loaded on the CPU it was built for."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def build_once(path: Path, command: Callable[[Path], list[str]]) -> str | None:
    """Builds `path` with `command(out)` unless it exists, through a temporary file renamed into place (a
    concurrent process loads the old file or the new one). Returns None, or the last line of what went wrong."""
    if path.is_file():
        return None
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(command(tmp), check=True, capture_output=True, text=True)
        tmp.replace(path)
        return None
    except (OSError, subprocess.CalledProcessError) as e:
        with contextlib.suppress(OSError):  # the folder itself may be what failed
            tmp.unlink(missing_ok=True)
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or [type(e).__name__]
        return detail[-1]
