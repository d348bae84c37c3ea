"""The few places where the supported Python (>= 3.10) and torch (2.11 to 2.14.1) releases differ, in one module.

Everything else in the suite uses one API on every supported release; a feature that needs a newer torch checks
`torch_at_least` and says so in one line instead of crashing.
"""

from __future__ import annotations

# torch is imported inside the functions: config loading (tomllib) must not pay for it.
import sys
from datetime import timedelta

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

__all__ = ["tomllib", "torch_at_least", "set_group_timeout"]


def torch_at_least(version: str) -> bool:
    """Whether the running torch is `version` (e.g. "2.12") or newer, ignoring local tags such as +cu130."""
    import torch

    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("+")[0].split(".")[:3] if p.isdigit())

    return parts(torch.__version__) >= parts(version)


def set_group_timeout(timeout: timedelta, group) -> None:
    """A new collective timeout for a process group: `dist.set_timeout` where torch has it (not 2.11), else the
    private setter that public function wraps."""
    import torch.distributed as dist

    setter = getattr(dist, "set_timeout", None)
    if setter is None:
        from torch.distributed.distributed_c10d import _set_pg_timeout as setter
    setter(timeout, group)
