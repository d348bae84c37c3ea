"""benchmarks/gpu_check.sh: the GPU check's dry run (every part on the CPU, tiny shapes) writes its 8 files with
the figures they promise, so the script works the day a GPU is there."""

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = {"summary.md", "log.txt", "titan.json", "titan_trace.json.gz", "titan_memory_ops.txt", "lcsm.json",
         "morphens.json", "tests.txt"}
RECIPES = ["baseline", "+compile", "+float8_titan", "+compile+float8_titan", "+float8_torchao",
           "+compile+float8_torchao", "+float8_rowwise", "+selective_ac"]


@pytest.fixture(scope="module")
def dry_run(module_tmp_path):
    out = module_tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "benchmarks/gpu_check.sh"), str(out), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_writes_exactly_its_eight_files(dry_run):
    assert {p.name for p in dry_run.iterdir()} == FILES


def test_titan_table_has_every_recipe_with_consistent_figures(dry_run):
    titan = json.loads((dry_run / "titan.json").read_text())
    rows = {r["recipe"]: r for r in titan["recipes"]}
    assert list(rows) == RECIPES and all(r["ok"] for r in rows.values()), rows
    peak = titan["measured_peak_tflops"]
    assert peak == max(titan["matmul_peak_tflops"].values()) > 0
    base = rows["baseline"]["final_loss"]
    args = titan["base_overrides"]
    tokens_per_step = int(args[args.index("--training.local_batch_size") + 1]) * int(
        args[args.index("--training.seq_len") + 1])
    for r in rows.values():
        # tps (the trainer's throughput window) against the tokens of a step over its time on the elapsed_s clock:
        # the same step measured twice, independently.
        assert r["tps"] == pytest.approx(tokens_per_step / r["step_s"], rel=0.05), r
        assert 0 < r["memory_gib"] < 64
        assert r["mfu_of_measured_peak"] == pytest.approx(100 * r["tflops"] / peak)
        # Against the peak of the dtype it trains in (fp32 here), no recipe can pass 100%.
        assert titan["peak_dtype"] == "float32" and 0 < r["mfu_of_measured_peak"] < 100, r
        # Same model, data and seed: compile and AC change no loss; float8 moves it by its rounding only.
        assert r["final_loss"] == pytest.approx(base, abs=0.02 if "float8" in r["recipe"] else 1e-4)
    # torchao's float8 (emulated on the CPU) computes what ours does, eager and compiled.
    for compiled in ("", "+compile"):
        ours, theirs = rows[f"{compiled}+float8_titan"]["final_loss"], rows[f"{compiled}+float8_torchao"]["final_loss"]
        assert theirs == pytest.approx(ours, rel=1e-6)
    checkpoint = titan["checkpoint"]
    assert checkpoint["exit_code"] == 0
    saves = checkpoint["saves_per_run"]
    assert saves == math.ceil(checkpoint["steps"] / checkpoint["interval"]) >= 2
    # The time a save blocks the loop is part of its run's wall time (sync and async runs alike).
    assert 0 < checkpoint["full_save_s"] * saves <= checkpoint["step_s_sync"] * checkpoint["steps"]
    assert 0 < checkpoint["blocked_per_save_s_async"] * saves <= checkpoint["step_s_async"] * checkpoint["steps"]


def test_trace_and_memory_record_are_the_profiled_step(dry_run):
    trace = json.loads(gzip.decompress((dry_run / "titan_trace.json.gz").read_bytes()))
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("ProfilerStep#") for n in names) and "aten::mm" in names
    assert "aten::" in (dry_run / "titan_memory_ops.txt").read_text()


def test_lcsm_records_are_exact_and_the_speedups_are_their_ratios(dry_run):
    lcsm = json.loads((dry_run / "lcsm.json").read_text())
    records = lcsm["records"]
    assert {(r["part"], r["seq_len"]) for r in records} == {("mixer", 64), ("mixer", 128), ("e2e", 64), ("e2e", 128)}
    assert max(r["max_abs_err"] for r in records) < 1e-4
    assert lcsm["paper"]["mixer_speedup"] == 110 and lcsm["paper"]["e2e_speedup"] == 7.8
    for row in lcsm["speedups"]:
        at = {r["method"]: r for r in records if (r["part"], r["seq_len"]) == (row["part"], row["seq_len"])}
        assert row["flash_s"] == min(r["total_s"] for m, r in at.items() if m.startswith("flash"))
        assert row["vs_lazy"] == pytest.approx(at["lazy"]["total_s"] / row["flash_s"])


def test_morphens_compares_eight_mothernet_members_with_eight_independent(dry_run):
    morphens = json.loads((dry_run / "morphens.json").read_text())
    assert morphens["exit_code"] == 0
    results = morphens["results"]
    assert {r["ensemble_size"] for r in results} == {8} and len({r["method"] for r in results}) == 2
    assert all(0 <= r["ensemble_acc"] <= 100 and len(r["member_acc"]) == 8 and r["train_cost"] > 0 for r in results)
    mother, independent = sorted(results, key=lambda r: r["method"] != "mothernets")
    assert mother["speedup"]["cost"] == pytest.approx(independent["train_cost"] / mother["train_cost"])
    assert morphens["device"] == "cpu" and {r["device"] for r in results} == {"cpu"}  # the dry run's device


def numerics_counts() -> str:
    """What the 4 numerics tests give on this torch: all pass, or (torch 2.11) the rowwise _scaled_mm one skips."""
    from titan.quantization.float8 import cpu_scaled_mm_supported

    return "4 passed" if cpu_scaled_mm_supported("rowwise") else "3 passed, 1 skipped"


def test_numerics_tests_ran_on_the_cpu_and_passed(dry_run):
    text = (dry_run / "tests.txt").read_text()
    assert text.startswith("exit 0") and numerics_counts() in text and "failed" not in text
    if "skipped" in text:
        assert "per-tensor scales only" in text  # the one skip says why


def test_summary_has_a_row_per_recipe_length_and_method(dry_run):
    summary = (dry_run / "summary.md").read_text()
    for recipe in RECIPES:
        assert f"| {recipe} |" in summary
    assert "| mixer | 128 |" in summary and "| e2e | 64 |" in summary and numerics_counts() in summary


def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    import torch  # already loaded by the suite: no process of its own just to ask

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = subprocess.run([str(ROOT / "benchmarks/gpu_check.sh"), str(tmp_path / "out")], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and "--dry-run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
