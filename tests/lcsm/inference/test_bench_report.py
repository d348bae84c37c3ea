"""lcsm.bench's report from hand-made records: the ratios, the table's derived columns, one plot panel per part
and batch."""

import matplotlib.image

from lcsm.inference.bench_report import find, plot, print_table, ratio_summary
from tests.conftest import assert_is_plot


def record(part, method, L, total_s, mixer_s, batch=1):
    return {"part": part, "method": method, "seq_len": L, "batch": batch, "total_s": total_s, "mixer_s": mixer_s,
            "us_per_token": total_s / (L - 1) * 1e6, "max_abs_err": 1e-7}


RECORDS = [record("e2e", "lazy", 65, 8.0, 6.0), record("e2e", "flash", 65, 2.0, 0.5),
           record("mixer", "flash_unbatched", 65, 3.0, 3.0), record("mixer", "flash_batched", 65, 1.2, 1.2),
           record("mixer", "lazy", 129, 4.0, 4.0), record("mixer", "flash", 129, 1.0, 1.0)]


def test_find_matches_part_method_length_and_batch():
    assert find(RECORDS, "e2e", "flash", 65, 1) is RECORDS[1]
    assert find(RECORDS, "e2e", "flash", 65, 2) is None


def test_ratio_summary_divides_lazy_by_flash_and_per_slot_by_batched_tiles():
    assert ratio_summary(RECORDS) == [
        "e2e L=65 B=1: flash 4.0x faster than lazy (mixer 12.0x)",
        "mixer L=65 B=1: tiles batched over slots 2.50x faster (mixer time) than per-slot tiles",
        "mixer L=129 B=1: flash 4.0x faster than lazy",
    ]


def test_table_shows_the_time_outside_the_mixer_per_token_and_the_ratio_to_lazy(capsys):
    print_table(RECORDS[:2])
    flash_row = capsys.readouterr().out.splitlines()[2].split()
    # (2.0 - 0.5) s over 64 generated tokens = 23437.5 us; lazy's 8 s over flash's 2 s.
    assert flash_row[6:9] == ["31250.0", "23437.5", "4.0"]


def test_plot_has_one_panel_per_part_and_batch(tmp_path):
    records = [*RECORDS, record("mixer", "lazy", 65, 2.0, 2.0, batch=4)]
    plot(records, tmp_path / "r.png")
    assert_is_plot(tmp_path / "r.png")
    assert matplotlib.image.imread(tmp_path / "r.png").shape[1] == round(3 * 5.5 * 110)
