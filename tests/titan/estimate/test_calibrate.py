"""Fitting the step-time model's constants on measured runs: runs made with known constants give them back, each
from the run that determines it, and the others keep their values."""

import dataclasses

import pytest

from titan.config import parse_args
from titan.estimate.calibrate import fit, fitted_constant, tokens_per_s
from titan.estimate.costs import Hardware
from titan.estimate.dry_run import plan

pytestmark = pytest.mark.filterwarnings("ignore:Slicing a flattened dim")

RUNS = {"mfu": ["--compile.enable", "false", "--float8.enable", "false"],
        "compile_speedup": ["--compile.enable", "true", "--float8.enable", "false"],
        "float8_speedup": ["--compile.enable", "true", "--float8.enable", "true"]}


@pytest.fixture(scope="module")
def plans():
    return {name: plan(parse_args(["--config", "configs/titan/llama3_8b_fsdp8_est.toml", "--model.n_layers", "2",
                                   *extra])) for name, extra in RUNS.items()}


def test_each_run_fits_the_constant_it_determines(plans):
    assert {name: fitted_constant(p.job_config) for name, p in plans.items()} == {name: name for name in RUNS}


def test_runs_made_with_known_constants_give_them_back(plans):
    truth = Hardware(mfu=0.37, compile_speedup=1.21, float8_speedup=1.44)
    measured = [(p, tokens_per_s(p, truth)) for p in plans.values()]
    got = fit(measured, Hardware())
    for name in RUNS:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert dataclasses.replace(got, **{n: getattr(truth, n) for n in RUNS}) == truth  # nothing else moved


def test_a_constant_no_run_determines_keeps_its_value(plans):
    truth = Hardware(mfu=0.42)
    got = fit([(plans["mfu"], tokens_per_s(plans["mfu"], truth))], Hardware(compile_speedup=1.7))
    assert got.mfu == pytest.approx(0.42, rel=1e-6) and got.compile_speedup == 1.7
