"""The one command-line runner of every entry point, and its exit contract.

    @entry_point
    def main(argv: list[str]) -> int: ...

    if __name__ == "__main__":
        run(main)

A user's mistake raises `UserError` where it is recognised: the runner prints one `error: ...` line (what is
wrong and the key, file or flag that fixes it) and exits 2. SIGINT and SIGTERM (what a preempted job gets) end
the command with one line and exit 130 / 143; a training run first writes a checkpoint. Anything else is a bug:
its traceback is kept and the exit code is 1.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn


class UserError(ValueError):
    """A mistake in a command's input; the message is one line naming the key, file or flag and the fix."""


def check_writable(path: str | Path, name: str, fix: str) -> None:
    """Refuses, before any work, a folder that cannot be created or written: its nearest existing ancestor must
    be a writable folder. `name` is the key or flag that set it, `fix` what to do instead."""
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(f"{name} {path} cannot be written ({probe} is not a writable folder); {fix}")


class Interrupted(BaseException):
    """SIGINT or SIGTERM ended the command; like KeyboardInterrupt, no `except Exception` swallows it."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signum, detail)
        self.signum, self.detail = signum, detail

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}{': ' + self.detail if self.detail else ''}"


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextmanager
def sigterm_raises():
    """SIGTERM raises Interrupted, as SIGINT raises KeyboardInterrupt (only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def duration(seconds: float) -> str:
    """`45.3s`, `2m15s`, `1h02m`: a command's time as its summary line gives it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def report_done(what: str, seconds: float, figure: str, outputs: str) -> str:
    """Prints, on rank 0, a command's last line: `done: <what ran> in <time>, <headline figure>, outputs in
    <where>`, and returns it."""
    line = f"done: {what} in {duration(seconds)}{', ' + figure if figure else ''}, outputs in {outputs}"
    if _is_rank_zero():
        print(line, flush=True)
    return line


def entry_point(fn: Callable[[list[str]], int]) -> Callable[[list[str] | None], int]:
    """Applies the exit contract to a command's `main(argv)`; a bug's exception propagates to the caller."""

    @functools.wraps(fn)
    def main(argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else list(argv)
        try:
            with sigterm_raises():
                return fn(argv)
        except UserError as e:
            text = str(e).strip()
            print(f"error: {text.splitlines()[0] if text else type(e).__name__}", file=sys.stderr, flush=True)
            return 2
        except (KeyboardInterrupt, Interrupted) as e:
            stop = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
            if _is_rank_zero():
                print(str(stop), file=sys.stderr, flush=True)
            return 128 + stop.signum

    return main


def run(main: Callable[[list[str] | None], int]) -> NoReturn:
    """Runs an entry point as a process: a bug's traceback and exit 1, then the process group is left and the
    process ends without running finalizers (gloo's worker threads can abort a clean interpreter exit)."""
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:  # argparse's --help (0) and usage errors (2, its own `error:` line) end this way
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        if code != 1:  # after a bug a peer may never reach the barrier; torchrun ends the others
            from titan.distributed.runtime import shutdown  # not at the top: everything in titan imports this module

            shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
