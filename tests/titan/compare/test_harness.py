"""`python -m titan.compare` tabulates recipes, and the compile recipe keeps the numerics.

Tolerance: inductor fuses and reorders reductions, so compiled fp32 losses match eager to rtol 1e-4.
"""

import json
import statistics

import pytest

from tests.conftest import assert_is_plot
from tests.titan.conftest import TINY, read_metrics
from titan.compare import harness as compare


def losses_of(records):
    return [r["loss"] for r in records]


def fake_run(tps_by_recipe, calls):
    def run_once(cmd, folder, timeout):
        recipe = "compile" if "--compile.enable" in cmd else "baseline"
        calls.append(recipe)
        records = [{"step": s, "tps": tps_by_recipe[recipe] * (10 if s == 1 else 1), "mfu": 1.0,
                    "memory_gib": 0.5 + s / 10, "loss": 9.0 - s} for s in range(1, 5)]
        return {"ok": True, "wall_s": 1.0, "records": records}
    return run_once


def test_compare_interleaves_rounds_and_summarizes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compare, "run_once", fake_run({"baseline": 100.0, "compile": 150.0}, calls))
    rows = compare.compare(["baseline", "+compile"], ["--model.n_layers", "2"], tmp_path, steps=4, rounds=3,
                           warmup=1, log=lambda _: None)
    assert calls == ["baseline", "compile"] * 3
    assert [r["tps"] for r in rows] == [100.0, 150.0]  # the 10x warm-up step is left out
    assert [r["speedup"] for r in rows] == [1.0, 1.5]
    assert rows[1]["memory_gib"] == pytest.approx(0.9) and rows[1]["final_loss"] == 5.0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["recipe"] for r in saved["recipes"]] == ["baseline", "+compile"] and saved["rounds"] == 3
    assert "| +compile | 150 |" in (tmp_path / "results.md").read_text()
    assert_is_plot(tmp_path / "results.png")


def test_recipe_names_stack_and_come_from_files(tmp_path):
    recipes_file = tmp_path / "recipes.toml"
    recipes_file.write_text('[small_batch]\ntraining.local_batch_size = 1\n"compile.enable" = true\n')
    table = compare.load_recipes(str(recipes_file))
    assert compare.resolve("+compile+float8_rowwise", table) == {
        "compile.enable": "true", "float8.enable": "true", "float8.recipe": "rowwise"}
    assert compare.resolve("small_batch", table) == {"training.local_batch_size": "1", "compile.enable": "true"}
    assert compare.resolve("baseline", table) == {}
    with pytest.raises(compare.CompareError, match="unknown recipe 'fast'"):
        compare.resolve("+compile+fast", table)
    assert compare.main(["--recipes", "+nosuch", "--out", str(tmp_path / "out")]) == 2


def test_compare_cli_runs_compile_with_selective_ac_at_eager_losses(tmp_path, monkeypatch, capsys):
    """The one compile test (2 layers, fp32): the harness's table for two recipes on the debug model."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cmp"
    code = compare.main(["--recipes", "baseline,+compile+selective_ac", "--steps", "4", "--rounds", "1",
                         "--warmup", "1", "--out", str(out), *TINY])
    *_, line = capsys.readouterr().out.strip().splitlines()
    rows = json.loads((out / "results.json").read_text())["recipes"]
    assert code == 0, rows
    assert [r["recipe"] for r in rows] == ["baseline", "+compile+selective_ac"]
    base, compiled = rows
    eager_run, compiled_run = (read_metrics(folder) for folder in sorted((out / "runs").glob("*/round-0")))
    assert len(eager_run) == 4 and losses_of(compiled_run) == pytest.approx(losses_of(eager_run), rel=1e-4)
    # A row's figures are its run's: the median throughput after the warm-up step, the peak memory; the eager
    # run's throughput is each step's 2 x 32 tokens over its seconds.
    for row, records in ((base, eager_run), (compiled, compiled_run)):
        assert row["tps"] == statistics.median(r["tps"] for r in records[1:])
        assert row["memory_gib"] == max(r["memory_gib"] for r in records)
    ratios = sorted(r["tps"] * (r["elapsed_s"] - p["elapsed_s"]) / 64 for p, r in zip(eager_run[1:], eager_run[2:]))
    assert 0.7 < ratios[len(ratios) // 2] < 1.3, ratios
    assert base["speedup"] == 1.0 and compiled["speedup"] == pytest.approx(compiled["tps"] / base["tps"])
    table = (out / "results.md").read_text().splitlines()
    assert any(line.startswith("| +compile+selective_ac | ") and line.endswith(f"| {compiled['speedup']:.2f}x |")
               for line in table), table
    fastest = max(rows, key=lambda r: r["speedup"])
    assert line.startswith("done: 2 recipes x 1 rounds in ") and line.endswith(
        f", fastest {fastest['recipe']} at {fastest['speedup']:.2f}x the first, outputs in {out} (results.md, "
        "results.json, results.png, runs/)"), line


def test_a_misspelt_base_override_stops_before_any_run(tmp_path, capsys, monkeypatch):
    from titan.compare import harness

    monkeypatch.setattr(harness, "run_once", lambda *a: pytest.fail("no run may start"))
    out = tmp_path / "out"
    assert harness.main(["--recipes", "baseline", "--out", str(out), "--training.stepz", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: recipe 'baseline': unknown key training.stepz")
    assert not out.exists()


def test_compare_puts_expert_parallel_beside_data_parallel_with_equal_losses(tmp_path, monkeypatch):
    """The ep2 recipe on 2 ranks against FSDP on 2 (tiny Qwen3-MoE, fp32): dropless routing gives the same losses
    and the same expert load, side by side in the table."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cmp"
    code = compare.main(["--recipes", "baseline,ep2", "--nproc", "2", "--steps", "3", "--rounds", "1", "--warmup",
                         "1", "--out", str(out), *TINY, "--model.name", "qwen3_moe"])
    rows = json.loads((out / "results.json").read_text())["recipes"]
    assert code == 0, rows
    fsdp, ep = rows
    assert ep["overrides"] == {"parallelism.expert_parallel_degree": "2"} and len(ep["losses"]) == 3
    assert ep["losses"] == pytest.approx(fsdp["losses"], rel=1e-5) and ep["max_loss_diff"] < 1e-4
    for key in ("moe_imbalance", "moe_imbalance_all_layers"):
        assert 1 <= ep[key] == pytest.approx(fsdp[key])
    header, _, *lines = (out / "results.md").read_text().splitlines()[2:]
    assert "| MoE imbalance (worst layer) | MoE imbalance (all layers) | speedup |" in header
    assert lines[1].startswith("| ep2 | ")
    assert f"| {ep['moe_imbalance']:.3f} | {ep['moe_imbalance_all_layers']:.3f} |" in lines[1]
