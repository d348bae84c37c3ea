"""Choices timed once per machine and shape, kept on disk: hybrid tau's kernel per tile, flash's tile batching.

The cache is one JSON file, `$LCSM_CACHE_DIR/autotune.json` (default ~/.cache/lcsm), with a section per machine
(processor or GPU, torch version, threads), so that a second run, or a second engine of the same shape, pays
nothing. A file that cannot be read or written only costs the timing again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lcsm.inference import accel
from titan.tools.agreement import locked
from titan.tools.native import processor

_CHOICES: dict[str, dict[str, str]] = {}
"""Sections of the cache file read so far: machine -> {key: choice}."""


def cache_file() -> Path:
    return Path(os.environ.get("LCSM_CACHE_DIR") or Path.home() / ".cache" / "lcsm") / "autotune.json"


def machine(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else processor()
    return f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def _read_all() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}


def choose(device: torch.device, key: str, candidates: dict[str, Callable[[], object]]) -> str:
    """The name of the fastest candidate for `key` on this machine: from the cache, or timed now and cached; the
    first candidate, untimed, where the accelerations are off (LCSM_ACCEL=0)."""
    if not accel.enabled():
        return next(iter(candidates))
    section = machine(device)
    if section not in _CHOICES:
        _CHOICES[section] = _read_all().get(section, {})
    choices = _CHOICES[section]
    if key not in choices:
        choices[key] = fastest(device, candidates)
        try:
            path = cache_file()
            with locked(path.parent):  # a concurrent process's choices, merged meanwhile, are kept
                everything = _read_all()
                everything[section] = {**everything.get(section, {}), **choices}
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(everything, indent=1, sort_keys=True))
                tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            pass
    return choices[key]


def fastest(device: torch.device, candidates: dict[str, Callable[[], object]], budget_s: float = 0.02) -> str:
    """Times each candidate about budget_s (at least one call after a warm-up); a candidate whose first call
    is 4x slower than the best so far is dropped without more calls."""
    # CPU time on the CPU, so that other jobs on a shared machine do not skew the choice.
    clock = time.perf_counter if device.type == "cuda" else time.process_time

    def timed(fn, reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (clock() - start) / reps

    timings: dict[str, float] = {}
    for name, fn in candidates.items():
        fn()  # warm-up (and Triton compilation)
        first = timed(fn, 1)
        if timings and first > 4 * min(timings.values()):
            continue
        reps = max(1, min(20, int(budget_s / max(first, 1e-6))))
        timings[name] = min(first, timed(fn, reps))
    return min(timings, key=timings.get)


def forget() -> None:
    """Drops the choices read into this process (tests point LCSM_CACHE_DIR elsewhere and start afresh)."""
    _CHOICES.clear()
