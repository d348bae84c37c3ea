"""Ranks that take the same decision, and files that each node builds once.

`agree` and `agreed` turn a problem that one rank sees (a file missing on its node, an error while building a
cache) into every rank's, so that no rank is left waiting in a collective for one that has raised. `built_once`
makes a cache file under a lock on its folder: on a node-local cache folder the first rank of each node builds it,
on a shared one the first rank of the job, and the others wait for the lock and then read it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from titan.tools.cli import UserError

T = TypeVar("T")
R = TypeVar("R")


def agree(error: T) -> T:
    """The first rank's error (a message or an exception), or None when every rank has none (a collective: all
    ranks call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    errors: list[T] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def agreed(action: Callable[[], R]) -> R:
    """Runs a rank-local action (no collectives inside) on every rank; when it raises a user-facing error or an
    OSError on any rank, every rank raises the first rank's, so none is left waiting in a later collective."""
    result, error = None, None
    try:
        result = action()
    except (UserError, OSError) as e:
        error = e
    if error := agree(error):
        raise error
    return result


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Holds an exclusive lock on `folder` (created if missing), for a read-modify-write or a build of a file in
    it: fcntl.flock on the folder itself, so no lock file is left behind, and the system releases it if the process
    dies. A filesystem without such locks (some network mounts) runs the block unlocked: writers still rename
    whole files into place."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                raise
        yield
    finally:
        os.close(fd)


def built_once(folder: Callable[[], Path], name: str, build: Callable[[Path], None]) -> Path:
    """The cache file `folder() / name`, made on every rank's filesystem where it is missing: `build(tmp)` writes
    it under a lock and it is renamed into place whole. A failure on any rank (a corpus without documents, a cache
    folder that cannot be written) is raised on every rank."""

    def make() -> Path:
        try:
            path = folder() / name
            with locked(path.parent):
                if not path.is_file():
                    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
                    try:
                        build(tmp)
                        os.replace(tmp, path)
                    finally:
                        tmp.unlink(missing_ok=True)
        except OSError as e:
            raise UserError(f"cannot write the cache file {name} ({type(e).__name__}: {e.strerror or e}: "
                            f"{e.filename}); set TITAN_CACHE_DIR to a writable folder") from None
        return path

    return agreed(make)
