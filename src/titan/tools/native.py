"""C code for CPU hot paths, built once per machine with the system's C compiler into a cache folder.

The packages that train through titan keep their own sources and fall back to torch ops where nothing can be
built; this module only finds the compiler, names the machine (its CPU model and enabled instruction sets, so
that code built with -march=native on one host is never loaded on another, e.g. through a shared home), and
builds a file atomically under a lock on its folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from titan.tools.agreement import locked

# -fno-trapping-math lets clamps vectorize, -fopenmp-simd the `#pragma omp simd` reductions (no threads: the
# library never links OpenMP's runtime); nothing here reads floating-point exception flags.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp-simd", "-shared", "-fPIC",
         "-std=c11"]
LIBS = ["-lm"]  # after the source: a linker with --as-needed drops libraries named before their use


def compiler() -> str | None:
    """$CC, else cc, gcc or clang from PATH: a path that runs, or None."""
    found = [shutil.which(name) for name in (os.environ.get("CC"), "cc", "gcc", "clang") if name]
    return next((path for path in found if path), None)


@functools.cache
def processor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and a digest of the instruction sets the system enables on it (/proc/cpuinfo's flags):
    code built with -march=native is only loaded on a CPU that has what it was built for. Two hosts with one model
    name can differ (a hypervisor or BIOS masking AVX-512, AMX or others)."""
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines[:64])}
    name = field.get("model name") or platform.machine()
    flags = field.get("flags") or field.get("Features") or ""  # x86 / ARM
    return f"{name} [{hashlib.sha256(' '.join(sorted(flags.split())).encode()).hexdigest()[:12]}]"


def build_once(path: Path, command: Callable[[Path], list[str]]) -> str | None:
    """Builds `path` with `command(out)` unless it exists, under a lock on its folder (processes sharing it build
    once), through a temporary file renamed into place (a concurrent reader loads no half-written file). Returns
    None, or the last line of what went wrong."""
    if path.is_file():
        return None
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        with locked(path.parent):  # processes sharing the folder build it once
            if not path.is_file():
                subprocess.run(command(tmp), check=True, capture_output=True, text=True)
                tmp.replace(path)
        return None
    except (OSError, subprocess.CalledProcessError) as e:
        with contextlib.suppress(OSError):  # the folder itself may be what failed
            tmp.unlink(missing_ok=True)
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or [type(e).__name__]
        return detail[-1]
