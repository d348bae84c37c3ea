"""Runs an entry point as real processes (one, or the ranks of a job) without paying torch's import in each.

A `python -m titan.train` spends 3-4 s of CPU importing torch before its first line runs, and torchrun's agent
imports it once more; the suite starts a few hundred such processes on two cores. Here every process is forked
from a server that imported the third-party libraries once (multiprocessing's forkserver; our own packages are
imported fresh in each child, so their import-time behaviour is still tested), and the ranks of a job get
torchrun's environment directly instead of an agent. A run whose environment differs from the server's in a
variable read when an interpreter or a library starts (PYTHON*, TORCH*, OMP_*, ...) gets a fresh interpreter;
so does an elastic job, which needs torchrun's agent.
"""

from __future__ import annotations

import atexit
import functools
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor", "numpy",
           "safetensors.torch"]
STARTUP_VARIABLES = re.compile(
    r"PYTHON(?!UNBUFFERED$)|TORCH(?!INDUCTOR_CACHE_DIR$|ELASTIC_|_NCCL_)|PYTORCH|OMP_|GOMP_|MKL_|CUDA|TRITON|LD_|MALLOC")
"""Read when the interpreter or a preloaded library starts, so a child cannot take another value than the server's
(the TORCH ones excepted are read when used; KMP_ is Intel's OpenMP, which torch's wheels do not load)."""
TERMINATE_GRACE_S = 30
"""How long the other ranks get after SIGTERM once one failed, as torchrun's agent gives them."""

SERVER_ENV = dict(os.environ)
"""The server's environment: the suite's as it started, before any test changed it."""
_warned: set[tuple[str, ...]] = set()


@functools.cache
def _forkserver():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(SERVER_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(current)
    return context


def _forkable(env: dict[str, str]) -> bool:
    changed = sorted(k for k in env.keys() | SERVER_ENV.keys()
                     if env.get(k) != SERVER_ENV.get(k) and STARTUP_VARIABLES.match(k))
    if changed and tuple(changed) not in _warned:
        # Visible in pytest's summary: a variable leaked into the suite's environment would otherwise make every
        # later run slow without a word.
        _warned.add(tuple(changed))
        warnings.warn(f"tests/launch.py: {', '.join(changed)} differ from the fork server's environment: these runs "
                      "start a fresh interpreter", stacklevel=3)
    return not changed


def _text_stream(fd: int, unbuffered: bool, errors: str, line_buffering: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=line_buffering,
                            write_through=unbuffered)


def _run_module(module: str, args: list[str], env: dict[str, str], cwd: str, out_path: str, err_path: str) -> None:
    """In the forked child: becomes `python -m module args` and exits as that interpreter would."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the server cached its own TMPDIR; the child's may differ (tests/conftest.py sets one)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _text_stream(1, unbuffered, "strict", line_buffering=False)
    sys.stderr = sys.__stderr__ = _text_stream(2, unbuffered, "backslashreplace", line_buffering=True)
    sys.argv = [module, *args]
    sys.path.insert(0, cwd)  # what `-m` puts first
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # An interpreter's exit: wait for non-daemon threads, then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(env: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun's agent gives worker `rank` of a one-node job (our runtime makes its own store)."""
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0"}


def _wait(procs, timeout: float) -> list[int]:
    """Every rank's exit code; once one fails the others are stopped as torchrun stops them."""
    deadline = time.monotonic() + timeout
    stop_at = None
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return codes
        if stop_at is None and any(c not in (None, 0) for c in codes):
            stop_at = time.monotonic() + TERMINATE_GRACE_S
            for p in procs:
                if p.exitcode is None:
                    p.terminate()
        now = time.monotonic()
        if now > deadline or (stop_at is not None and now > stop_at):
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join()
            if now > deadline:
                raise TimeoutError
            return [p.exitcode for p in procs]
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.2)


def run_module(module: str, args: list[str], env: dict[str, str], nproc: int = 1,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m module args` in `nproc` ranks, as `subprocess.run(..., capture_output=True, text=True)` gives it:
    the ranks' output interleaved as under torchrun, exit code 1 if a rank failed (torchrun's), else 0."""
    cmd = [sys.executable, "-m", module, *args]
    if not _forkable(env):
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", module, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        out.touch()
        err.touch()
        port = free_port() if nproc > 1 else 0
        procs = []
        for rank in range(nproc):
            rank_environ = rank_env(env, rank, nproc, port) if nproc > 1 else env
            proc = context.Process(target=_run_module,
                                   args=(module, args, rank_environ, os.getcwd(), str(out), str(err)))
            proc.start()
            procs.append(proc)
        try:
            codes = _wait(procs, timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read_text(), stderr=err.read_text()) from None
        if nproc == 1:
            code = codes[0]
        else:
            code = 0 if all(c == 0 for c in codes) else 1
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def run_ranks(module: str, args: list[str], out: Path, nproc: int = 2, timeout: float = 120) -> list[dict]:
    """Runs `python -m module *args OUT` in `nproc` ranks and returns what each wrote with `report_rank`."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    proc = run_module(module, [*args, str(out)], os.environ | {"OMP_NUM_THREADS": "1"}, nproc=nproc,
                      timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def report_rank(out: Path, result: dict) -> None:
    """In a rank of `run_ranks`: writes its result to OUT/rank<r>.json, then leaves the process group with the
    others."""
    import json

    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
