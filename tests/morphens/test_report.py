"""The report of a sweep: the console table, results.json and the frontier figure."""

import json

import matplotlib.image

from morphens import report
from morphens.config import load_config
from morphens.records import MethodResult, Seconds, Speedup, TimeSplit


def row(method, budget, acc, flops, wall, cpu, speedup=None):
    return MethodResult(method, 2, "cpu", acc, [acc - 2.0, acc - 1.0], flops, 1.0,
                        TimeSplit(hatch=Seconds(wall * 0.25, 0.0), members=Seconds(wall * 0.75, cpu)), budget,
                        speedup=speedup)


RESULTS = [row("mothernets", 0.5, 92.5, 2e9, 10.0, 8.0, Speedup(4.0, 2.5, 3.0)), row("independent", 0.5, 92.75, 8e9,
           25.0, 24.0), row("snapshot", 1.0, 92.0, 4e9, 12.0, 12.0)]


def test_table_has_one_row_per_method_and_ratios_only_beside_a_baseline():
    lines = report.table(RESULTS).splitlines()
    assert lines[0].split() == ["K", "budget", "method", "member", "acc", "ensemble", "GFLOPs", "wall", "s", "cpu",
                                "s", "cost", "x", "wall", "x", "cpu", "x"]
    assert lines[1].split() == ["2", "0.5", "mothernets", "91.00%", "92.50%", "2.0", "10.0", "8.0", "4.00", "2.50",
                                "3.00"]
    assert lines[2].split() == ["2", "0.5", "independent", "91.25%", "92.75%", "8.0", "25.0", "24.0"]
    assert len({len(line) for line in lines}) == 1  # ratio columns left blank keep the table aligned


def test_write_saves_the_config_and_typed_records_and_a_two_panel_figure(tmp_path):
    cfg = load_config("", [("run.out", str(tmp_path / "out")), ("training.epochs", "3")])
    out = report.write(cfg, RESULTS)
    saved = json.loads((out / "results.json").read_text())
    assert saved["config"]["training"]["epochs"] == 3.0
    first = saved["results"][0]
    assert first["method"] == "mothernets" and first["wall_s"] == 10.0 and first["cpu_s"] == 8.0
    assert first["time"]["hatch"] == {"wall": 2.5, "cpu": 0.0} and first["speedup"]["wall"] == 2.5
    assert saved["results"][1]["speedup"] is None and saved["results"][2]["budget"] == 1.0
    height, width, _ = matplotlib.image.imread(out / "results.png").shape
    assert (width, height) == (1320, 504)  # 11 x 4.2 inches at 120 dpi


def test_merge_plots_the_records_of_several_runs_together(tmp_path):
    """Two runs' results.json (budgets run apart): the records come back as written, in the files' order."""
    first = report.write(load_config("", [("run.out", str(tmp_path / "a"))]), RESULTS[:2])
    second = report.write(load_config("", [("run.out", str(tmp_path / "b"))]), RESULTS[2:])
    merged = report.merge([str(first / "results.json"), str(second / "results.json")], str(tmp_path / "both"),
                          cpu=True)
    assert merged == RESULTS
    assert matplotlib.image.imread(tmp_path / "both" / "results.png").shape[:2] == (504, 1320)
