"""The public paths kept at lcsm's top level: `python -m lcsm.bench`, `python -m lcsm.generate`, `lcsm.hyena`."""

import json
import os

import lcsm.bench
import lcsm.generate
import lcsm.hyena
from lcsm.inference import bench, generate
from lcsm.model import spec
from tests.launch import run_module


def test_top_level_modules_are_the_inference_and_model_ones():
    assert lcsm.bench.main is bench.main and lcsm.generate.main is generate.main
    assert lcsm.hyena.hyena_spec is spec.hyena_spec


def test_python_m_lcsm_bench_runs(tmp_path):
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    argv = ["--parts", "mixer", "--lengths", "8", "--methods", "lazy", "--batch", "1", "--out", str(tmp_path)]
    proc = run_module("lcsm.bench", argv, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = json.loads((tmp_path / "results.json").read_text())
    assert (record["method"], record["seq_len"]) == ("lazy", 8) and record["max_abs_err"] < 1e-5
    *_, line = proc.stdout.strip().splitlines()
    assert line.startswith("done: 1 benchmark runs in ") and f"max error {record['max_abs_err']:.1e}" in line, line
    assert line.endswith(f"outputs in {tmp_path} (results.json, results.png)"), line
