"""Fits the step-time model's free constants (`--estimate.mfu`, `compile_speedup`, `float8_speedup`) on measured
runs, so that the model's figures on other runs are predictions, not the measurements fed back.

Each measured run fits one constant, the others held: a run without compile and float8 fits `mfu`, one with
compile (and without float8) `compile_speedup`, one with both `float8_speedup`, in that order. The estimate's
tokens/s rises with each constant, so bisection (on a log scale) finds the value that reproduces the run.
"""

from __future__ import annotations

import dataclasses

from titan.estimate.costs import Hardware
from titan.estimate.dry_run import Plan, estimate

# The constant each kind of run fits, in fitting order, and the interval searched.
FITS = {"mfu": (0.02, 1.0), "compile_speedup": (0.5, 4.0), "float8_speedup": (0.5, 4.0)}


def fitted_constant(job_config) -> str:
    """The constant a measured run of `job_config` fits (see the module docstring)."""
    if job_config.float8.enable:
        return "float8_speedup"
    return "compile_speedup" if job_config.compile.enable else "mfu"


def tokens_per_s(planned: Plan, hw: Hardware) -> float:
    return estimate(planned.job_config, hw, planned)["step"]["tokens_per_s_per_gpu"]


def solve(planned: Plan, hw: Hardware, name: str, measured_tps: float, iterations: int = 40) -> float:
    """The value of constant `name` with which the estimate of `planned` gives `measured_tps` (clamped to its
    interval when no value does)."""
    lo, hi = FITS[name]
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        if tokens_per_s(planned, dataclasses.replace(hw, **{name: mid})) < measured_tps:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def fit(measured: list[tuple[Plan, float]], hw: Hardware) -> Hardware:
    """`hw` with the constants that `measured` (dry-run plans and their measured tokens/s per GPU) determine; a
    constant no run determines keeps its value. Two runs fitting one constant: an error (ambiguous)."""
    by_name: dict[str, tuple[Plan, float]] = {}
    for planned, tps in measured:
        name = fitted_constant(planned.job_config)
        if name in by_name:
            raise ValueError(f"two measured runs fit {name}; give one per constant")
        by_name[name] = (planned, tps)
    for name in FITS:
        if name in by_name:
            planned, tps = by_name[name]
            hw = dataclasses.replace(hw, **{name: solve(planned, hw, name, tps)})
    return hw
