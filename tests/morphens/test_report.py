"""The report of a sweep: the console table, results.json and the figure."""

import json

import matplotlib.image

from morphens import report
from morphens.config import load_config

RESULTS = [
    {"method": "mothernets", "ensemble_size": 2, "member_acc": [90.0, 91.0], "ensemble_acc": 92.5,
     "train_cost": 2e9, "wall_s": 10.0, "cpu_s": 8.0, "cost_ratio": 4.0, "wall_ratio": 2.5, "cpu_ratio": 3.0},
    {"method": "independent", "ensemble_size": 2, "member_acc": [89.0, 90.0], "ensemble_acc": 92.75,
     "train_cost": 8e9, "wall_s": 25.0, "cpu_s": 24.0},
]


def test_table_has_one_row_per_method_and_ratios_only_for_mothernets():
    lines = report.table(RESULTS).splitlines()
    assert lines[0].split() == ["K", "method", "member", "acc", "ensemble", "GFLOPs", "wall", "s", "cpu", "s",
                                "cost", "x", "wall", "x", "cpu", "x"]
    assert lines[1].split() == ["2", "mothernets", "90.50%", "92.50%", "2.0", "10.0", "8.0", "4.00", "2.50", "3.00"]
    assert lines[2].split() == ["2", "independent", "89.50%", "92.75%", "8.0", "25.0", "24.0"]
    assert len({len(line) for line in lines}) == 1  # ratio columns left blank keep the table aligned


def test_write_saves_the_config_and_results_and_a_two_panel_figure(tmp_path):
    cfg = load_config("", [("run.out", str(tmp_path / "out")), ("training.epochs", "3")])
    out = report.write(cfg, RESULTS)
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"] == RESULTS and saved["config"]["training"]["epochs"] == 3.0
    height, width, _ = matplotlib.image.imread(out / "results.png").shape
    assert (width, height) == (1320, 504)  # 11 x 4.2 inches at 120 dpi
